#!/usr/bin/env bash
# GPU vLLM 0.34 for the offline GPU host, in parts of one transfer each, into .gpu034/ (ignored).
#
# The shared gpu-vllm tool stages vLLM 0.26, the newest release built against the host's own
# torch 2.11. vLLM 0.34 (the newest release) pins torch 2.14.0, so the torch stack travels too:
# torch 2.14.0, triton 3.8.0, torchvision 0.29.0 and NCCL (torch 2.14 calls NCCL functions that the
# host's 2.28.9 lacks; 2.30.7, its pin, is not on the index, 2.32.6 has them all). The rest of the
# CUDA libraries are the host's (cuda-toolkit 13.0.2 against a pin of 13.0.3, cuDNN 9.19 against
# 9.24: the install line links them into /tmp/site/nvidia and sets PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK,
# as no model here runs a cuDNN kernel). vLLM's light dependencies are resolved by pip from its own
# metadata; its heavy optional ones stay behind (flashinfer, tilelang, humming, tokenspeed, torchcodec,
# PyNvVideoCodec, fastsafetensors, instanttensor, cudnn-frontend), as in the 0.26 bundle.
# CuTe DSL and quack-kernels travel: 0.34's engine imports MiniMax-M3's sparse attention ops at start,
# and they import `cutlass.cute` and `quack.compile_utils` at module level (seen on an H100, 2026-12-07:
# "No module named 'cutlass'"; quack is next in the same module, read in the wheel). CuTe DSL's
# payload spans nvidia-cutlass-dsl-libs-base, -core (the `cutlass` Python package) and -cu13, under
# nvidia_cutlass_dsl/dsl_packages, which a .pth adds to sys.path; PYTHONPATH ignores .pth files, so
# the install line links that folder's packages into /tmp/site (links, not copies: CuTe DSL finds its
# runtime library, nvidia_cutlass_dsl/cu13/lib, among the ancestors of its own resolved path).
#
# Usage, from the checkout's root (10-16 min here: xz of ~3.3 GB on 2 cores; 18 parts):
#     bash deploy/gpu_host/vllm034_bundle.sh
# then send .gpu034/pNN one per transfer to one warm host (back to back), and run the install line
# that .gpu034/plan.txt prints in the last one. Seen on 2026-12-07 with the parts of this recipe less
# CuTe DSL: 17 parts, ~4 s a transfer, install 150 s; torch 2.14.0+cu130 saw the GPU and NCCL 2.30.7,
# vLLM 0.34.0 and pdserve imported, the GPU kernel tests passed (62).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
D=.gpu034
grep -qx "/$D/" .git/info/exclude 2>/dev/null || echo "/$D/" >> .git/info/exclude
rm -rf "$D" && mkdir -p "$D/wheels"

plat=(--python-version 3.12 --implementation cp --only-binary=:all:)
for n in 5 12 17 24 27 28 31 34 35; do plat+=(--platform "manylinux_2_${n}_x86_64"); done
plat+=(--platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64)
get() { python3 -m pip download -q --no-deps "${plat[@]}" -d "$D/wheels" "$@" 2> >(grep -v 'is ignored' >&2); }

get vllm==0.34.0 torch==2.14.0 triton==3.8.0 torchvision==0.29.0 nvidia-nccl-cu13==2.32.6 redis==8.1.0 \
    nvidia-cutlass-dsl==4.8.0 nvidia-cutlass-dsl-libs-base==4.8.0 nvidia-cutlass-dsl-libs-core==4.8.0 \
    nvidia-cutlass-dsl-libs-cu13==4.8.0 quack-kernels==0.6.5

# vLLM's own requirements less the torch stack, the heavy optional kernels and what the image has; the
# s390x-only pins go, and the other markers (all true on the host: x86_64, Linux, Python 3.12)
unzip -p "$D"/wheels/vllm-0.34.0-*.whl '*/METADATA' | sed -n 's/^Requires-Dist: //p' | grep -v 'extra ==' \
    | grep -v '; platform_machine == "s390x"$' \
    | grep -v -i -E '^(torch|pynvvideocodec|flashinfer|tilelang|nvidia-|fastsafetensors|instanttensor|quack|tokenspeed|humming|numba|opencv)' \
    | sed 's/ *;.*//' | sort -u > "$D/requirements.txt"
python3 -m pip install -q --dry-run --ignore-installed --target "$D/resolve" "${plat[@]}" --report "$D/report.json" \
    -r "$D/requirements.txt" 2> >(grep -v 'is ignored' >&2)
python3 - "$D/report.json" > "$D/deps.txt" <<'PY'
import json, sys
skip = ("torch", "triton", "numpy", "opencv-python-headless", "cuda-bindings", "cuda-pathfinder")
for item in json.load(open(sys.argv[1]))["install"]:
    name, version = item["metadata"]["name"].lower().replace("_", "-"), item["metadata"]["version"]
    if name not in skip and not name.startswith("nvidia-"):
        print(f"{name}=={version}")
PY
get -r "$D/deps.txt"
dups=$(ls "$D"/wheels/*.whl | sed 's#.*/##' | cut -d- -f1 | tr 'A-Z_.' 'a-z--' | sort | uniq -d)
[ -z "$dups" ] || { echo "two versions of: $dups"; exit 1; }

# wheels re-stored uncompressed, then xz over all of them: about a third smaller than the wheels
mkdir -p "$D/stored"
python3 - "$D/wheels" "$D/stored" <<'PY'
import os, sys, zipfile
src, dst = sys.argv[1], sys.argv[2]
for name in sorted(os.listdir(src)):
    with zipfile.ZipFile(os.path.join(src, name)) as zi, \
            zipfile.ZipFile(os.path.join(dst, name), "w", zipfile.ZIP_STORED) as zo:
        for info in zi.infolist():
            out = zipfile.ZipInfo(info.filename, date_time=info.date_time)
            out.external_attr = info.external_attr
            zo.writestr(out, zi.read(info))
PY
tar -cf - -C "$D/stored" . | xz -T0 -6 -c > "$D/bundle.tar.xz"
rm -rf "$D/stored" "$D/resolve"

# parts as large as a transfer allows beside the tree that travels with each
travel=$(git ls-files -z -co --exclude-standard | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
room=$(( 63 * 1048576 - travel ))
size=$(stat -c %s "$D/bundle.tar.xz")
n=$(( (size + room - 1) / room ))
split -b $(( (size + n - 1) / n )) -d -a 2 --numeric-suffixes=1 "$D/bundle.tar.xz" "$D/p"
sum=$(sha256sum "$D/bundle.tar.xz" | cut -d' ' -f1)
rm -f "$D/bundle.tar.xz"
site=/opt/torch/.venv/lib/python3.12/site-packages  # the image's python (KINDS.md)
{
    echo "# vLLM 0.34.0 + torch 2.14.0 stack: $(ls "$D"/wheels | wc -l) wheels, $n parts; send each as"
    echo "#   carry [\"$D/pNN\"], command: mkdir -p /root/parts && cp $D/pNN /root/parts/"
    echo "# then, in the last transfer's command after its copy:"
    echo "cat /root/parts/p[0-9][0-9] > /root/bundle && echo '$sum  /root/bundle' | sha256sum -c --quiet" \
         "&& rm -rf /root/parts /root/whl && mkdir -p /root/whl && python3 -c \"import lzma,shutil,sys;" \
         "shutil.copyfileobj(lzma.open(sys.argv[1]),sys.stdout.buffer,1<<22)\" /root/bundle | tar -x -C /root/whl" \
         "&& rm /root/bundle && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir" \
         "--target /tmp/site /root/whl/*.whl && rm -rf /root/whl" \
         "&& for d in $site/nvidia/*; do [ -e /tmp/site/nvidia/\$(basename \$d) ] || ln -s \$d /tmp/site/nvidia/; done" \
         "&& for d in /tmp/site/nvidia_cutlass_dsl/dsl_packages/*; do ln -sfn \$d /tmp/site/; done" \
         "&& export PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1 || exit 1"
    echo "# later commands on that host: deploy/gpu_host/session.sh (host_env.sh sets the environment)"
} | tee "$D/plan.txt"
rm -rf "$D/wheels"
