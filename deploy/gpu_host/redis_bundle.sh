#!/usr/bin/env bash
# This machine's redis-server and the libraries a bare GPU host may lack, into .redis-gpu/ (ignored),
# to carry with a transfer: with it the GPU tests and benchmarks run their workers registered in
# Redis (the router's LMCache lookups and discovery), as users run them. The H200 host has no
# redis-server. Needs glibc >= 2.34 there (Debian 12's build); host_env.sh puts it on PATH only if
# it runs.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
src="$(readlink -f "$(command -v redis-server)")"
rm -rf .redis-gpu && mkdir -p .redis-gpu/lib .redis-gpu/bin
cp "$src" .redis-gpu/redis-server.bin
# the libraries only for redis itself: a python that found this libstdc++ first could break
cat > .redis-gpu/bin/redis-server <<'SH'
#!/bin/sh
here="$(dirname "$(readlink -f "$0")")/.."
LD_LIBRARY_PATH="$here/lib" exec "$here/redis-server.bin" "$@"
SH
chmod +x .redis-gpu/bin/redis-server
ldd "$src" | awk '/=> \// {print $3}' | grep -v -E '/(libc|libm|libpthread|libdl|librt)\.so' \
    | xargs -I{} cp -L {} .redis-gpu/lib/
grep -qx "/.redis-gpu/" .git/info/exclude 2>/dev/null || echo "/.redis-gpu/" >> .git/info/exclude
du -sh .redis-gpu
