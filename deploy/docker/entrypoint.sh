#!/bin/sh
# Entry point of the pdserve images: `docker run IMAGE <pdserve command> [flags]`.
#
# A scaled compose service (`docker compose up --scale decode=3`) runs one command in
# several containers, so a worker cannot spell its own address in docker-compose.yml.
# Unless the command gives --advertise-url, a prefill or decode worker started with
# --port tells the router this container's address on the compose network.
set -eu

role="${1:-}"
case "$role" in
prefill | decode)
    port=""
    prev=""
    advertised=""
    for arg in "$@"; do
        [ "$arg" = "--" ] && break # vLLM's flags follow
        case "$arg" in
        --advertise-url | --advertise-url=*) advertised=1 ;;
        --port=*) port="${arg#--port=}" ;;
        esac
        [ "$prev" = "--port" ] && port="$arg"
        prev="$arg"
    done
    if [ -z "$advertised" ] && [ -n "$port" ]; then
        ip=$(python3 -c 'import socket; print(socket.gethostbyname(socket.gethostname()))')
        shift
        set -- "$role" --advertise-url "http://$ip:$port" "$@"
    fi
    ;;
esac
exec pdserve "$@"
