#!/usr/bin/env bash
# Run HERE, from the project root, after ../shared/device/prepare.sh: repacks ./.carry so that PyAV (W5's
# video clips, 34 MiB as a wheel) fits the device tool's 64 MiB per call beside tritonserver and the tree.
#   .carry/triton-dist.tar.xz  tritonserver's ICU data library (29 MB; only libxml2 reaches it, for cloud
#                              model repositories) replaced by a stub of the same soname and symbol
#   .carry/wheels.tar.xz       every wheel of .carry/wheels and PyAV, stored uncompressed in one xz tarball;
#                              PyAV's x264, x265 and SVT-AV1 encoder libraries are stubs (W5 encodes MPEG-4
#                              and AAC, which libavcodec has built in)
#   .carry/device/env.sh       installs from wheels.tar.xz when it is there
# Then carry [".carry/triton-dist.tar.xz", ".carry/wheels.tar.xz", ".carry/device"] (about 56 MB).
# A stub defines each symbol its users import: functions that return 0, data that reads as zeros. Nothing
# on the benchmark's path calls them; anything that did would fail loudly, not quietly.
set -euo pipefail
export LC_ALL=C  # sort and join agree on order
root=$(git rev-parse --show-toplevel); cd "$root"
[ -d .carry/wheels ] && [ -f .carry/device/env.sh ] || { echo "run ../shared/device/prepare.sh first" >&2; exit 1; }
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT

# stub LIB USER: LIB replaced by a library of the same soname that defines the symbols USER imports from it
stub() {
  local lib=$1 user=$2 soname
  soname=$(readelf -d "$lib" | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p')
  nm -D --undefined-only "$user" | awk '{print $2}' | sed 's/@.*//' | sort -u > "$work/wanted"
  nm -D --defined-only "$lib" | awk '{print $2, $3}' | sed 's/@.*//' | sort -k2 -u \
    | join -1 2 -2 1 -o 1.1,1.2 - "$work/wanted" \
    | awk '$1 ~ /^[TtWi]$/ {print "long " $2 "(void) { return 0; }"; next} {print "char " $2 "[4096];"}' > "$work/stub.c"
  gcc -shared -fPIC -O2 -Wl,-soname,"$soname" -o "$lib" "$work/stub.c"
  strip "$lib"
}

mkdir -p "$work/triton" && tar xJf .carry/triton-dist.tar.xz -C "$work/triton"
libs="$work/triton/nvidia_pytriton.libs"
stub "$(ls "$libs"/libicudata-*)" "$(ls "$libs"/libicuuc-*)"
(cd "$work/triton" && tar cf - pytriton nvidia_pytriton.libs | xz -9 -T0 > "$root/.carry/triton-dist.tar.xz.new")

python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 -d "$work/dl" "av==18.1.0"
mkdir -p "$work/av" "$work/w"
(cd "$work/av" && unzip -q "$work"/dl/av-*.whl)
codec=$(ls "$work"/av/av.libs/libavcodec-*)
for name in x264 x265 SvtAv1Enc; do stub "$(ls "$work"/av/av.libs/lib$name-*)" "$codec"; done
(cd "$work/av" && zip -q -0 -r "$work/w/$(basename "$work"/dl/av-*.whl)" .)
for whl in .carry/wheels/*.whl; do  # stored, so that xz sees the bytes once for all of them
  mkdir "$work/x" && (cd "$work/x" && unzip -q "$root/$whl" && zip -q -0 -r "$work/w/$(basename "$whl")" .) && rm -rf "$work/x"
done
(cd "$work" && tar cf - w | xz -9 -T0 > "$root/.carry/wheels.tar.xz")
mv .carry/triton-dist.tar.xz.new .carry/triton-dist.tar.xz

grep -q wheels.tar.xz .carry/device/env.sh || python3 - <<'EOF'
p = ".carry/device/env.sh"
s = open(p).read()
old = "  /tmp/omni-env/bin/python -m pip install -q --no-index --no-deps --no-compile .carry/wheels/*.whl\n"
new = ("  if [ -f .carry/wheels.tar.xz ]; then tar xJf .carry/wheels.tar.xz -C /tmp && wheels=/tmp/w; else wheels=.carry/wheels; fi\n"
       "  /tmp/omni-env/bin/python -m pip install -q --no-index --no-deps --no-compile \"$wheels\"/*.whl\n")
assert old in s, "env.sh's install line changed: update perf/device_carry.sh"
open(p, "w").write(s.replace(old, new))
EOF
du -cb .carry/triton-dist.tar.xz .carry/wheels.tar.xz .carry/device | tail -1
