#!/usr/bin/env bash
# Builds a release of exla_rs: the precompiled NIFs RustlerPrecompiled downloads, their checksum
# file, and the Hex package.
#
#   scripts/release.sh [--out DIR] [--nif-versions "2.15 2.16 2.17"] [--no-package | --package-only]
#
# Writes into DIR (default _release/v<version>, ignored by git):
#   libexla_rs_nif-v<version>-nif-<N>-x86_64-unknown-linux-gnu.so.tar.gz   one per NIF version
#   checksum-Elixir.ExlaRs.NIF.exs     sha256 of each, the file the Hex package ships
#   exla_rs-<version>.tar              the Hex package (mix hex.build), checksum file included
#
# Publish: upload the .tar.gz files to the release's base URL (the GitHub release v<version>,
# or a mirror), then `mix hex.publish package` from the staging copy printed at the end.
#
# Every artifact embeds every CUDA kernel (sm_80, sm_90 and sm_90a machine code, compute_80 PTX;
# sm_86/sm_89 GPUs run the sm_80 images), so one file serves CPU-only and GPU machines: nvcc is required (scripts/env.sh
# finds the pip nvcc setup.sh installs), and the script refuses an artifact without them.
# Only x86_64-unknown-linux-gnu is built; see docs/getting-started.md for the other targets.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
source scripts/env.sh

nif_versions="2.15 2.16 2.17"
out=""
package=1 artifacts=1
while (($#)); do
  case $1 in
    --out) out=$2; shift 2 ;;
    --nif-versions) nif_versions=$2; shift 2 ;;
    --no-package) package=0; shift ;;
    --package-only) artifacts=0; shift ;;   # re-package with the artifacts and checksum file already in DIR
    *) echo "release.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done

version=$(sed -n 's/^  @version "\(.*\)"$/\1/p' mix.exs)
[[ -n $version ]] || { echo "release.sh: no @version in mix.exs" >&2; exit 1; }
target=x86_64-unknown-linux-gnu
host=$(rustc -vV | sed -n 's/^host: //p')
if [[ $host != "$target" ]]; then
  echo "release.sh: builds $target artifacts on an $target host (this is $host)" >&2
  exit 1
fi
out=${out:-$root/_release/v$version}
mkdir -p "$out"
out=$(cd "$out" && pwd)

# The kernels must be compiled in, not left to NVRTC at first use.
if [[ ${EXLA_RS_CUDA_NVCC:-} =~ ^(0|off|false|no)$ ]]; then
  echo "release.sh: EXLA_RS_CUDA_NVCC=$EXLA_RS_CUDA_NVCC would leave the CUDA kernels out" >&2
  exit 1
fi
nvcc=${NVCC:-${CUDA_HOME:+$CUDA_HOME/bin/nvcc}}
cuobjdump=${CUDA_HOME:+$CUDA_HOME/bin/cuobjdump}
for tool in "$nvcc" "$cuobjdump"; do
  if [[ -z $tool || ! -x $tool ]]; then
    echo "release.sh: nvcc and cuobjdump are needed (CUDA_HOME=${CUDA_HOME:-unset}; scripts/setup.sh installs NVIDIA's pip wheels)" >&2
    exit 1
  fi
done
unset EXLA_RS_CUDA_ARCHS   # the default list: every architecture the kernels support

# Reproducible tarballs: fixed owner, mode and time, no name or time in the gzip header.
pack() { # pack DIR FILE TARBALL
  tar -C "$1" --owner=0 --group=0 --numeric-owner --mode=0644 --mtime=@0 -cf - "$2" | gzip -9n >"$3"
}

# check_kernels SO: every kernel file's fatbin is inside (build.rs embeds them as data, so
# cuobjdump does not see them in the library itself): cut each fatbin out by its header (magic
# 0xBA55ED50, u16 version, u16 header size, u64 payload size) and list its images. Each kernel
# file must be there, with sm_80 and sm_90 cubins and compute_80 PTX for the mma.sync set (one
# file per dtype, head dim and feature set), and sm_90a cubins for the sm90 set.
check_kernels() {
  local dir=$stage/fatbins
  rm -rf "$dir" && mkdir -p "$dir"
  python3 - "$1" "$dir" <<'PY'
import struct, sys
data, out, n, at = open(sys.argv[1], "rb").read(), sys.argv[2], 0, 0
while (at := data.find(struct.pack("<I", 0xBA55ED50), at)) >= 0:
    version, header, size = struct.unpack_from("<HHQ", data, at + 4)
    if version == 1 and header == 16 and 0 < size < len(data):
        open(f"{out}/{n:03}.fatbin", "wb").write(data[at:at + header + size])
        n, at = n + 1, at + header + size
    else:
        at += 4
PY
  local f elf ptx all_elf="" all_ptx="" files=0
  for f in "$dir"/*.fatbin; do
    [[ -e $f ]] || break
    files=$((files + 1))
    elf=$("$cuobjdump" --list-elf "$f" 2>/dev/null || true)
    ptx=$("$cuobjdump" --list-ptx "$f" 2>/dev/null || true)
    all_elf+=$elf$'\n' all_ptx+=$ptx$'\n'
  done
  local want=$(ls native/exla_rs/kernels/inst/*.cu native/exla_rs/kernels/sm90/inst/*.cu | wc -l)
  local mma=$(ls native/exla_rs/kernels/inst/*.cu | wc -l) sm90=$(ls native/exla_rs/kernels/sm90/inst/*.cu | wc -l)
  ((files == want)) || { echo "release.sh: $1 holds $files kernel fatbins, not $want" >&2; return 1; }
  local arch count
  for arch in sm_80 sm_90 sm_90a; do
    count=$(grep -c "\.$arch\.cubin" <<<"$all_elf" || true)
    [[ $arch == sm_90a ]] && need=$sm90 || need=$mma
    ((count >= need)) || { echo "release.sh: $1 has $count $arch cubins, not $need" >&2; return 1; }
  done
  count=$(grep -c "\.sm_80\.ptx" <<<"$all_ptx" || true)
  ((count >= mma)) || { echo "release.sh: $1 has $count compute_80 PTX images, not $mma" >&2; return 1; }
  echo "  kernels: $files fatbins, $(grep -c cubin <<<"$all_elf") cubins ($(grep -o 'sm_[0-9a]*\.cubin' <<<"$all_elf" | sort | uniq -c | awk '{printf "%s %s, ", $1, $2}' | sed 's/\.cubin//g; s/, $//')), $count PTX"
}

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
build_artifacts() { # one artifact per NIF version, then the checksum file
  checksums=()
  # The crate's default (2.16) last, and built with the default features rather than naming them:
  # `--no-default-features --features nif_version_2_16` is another feature set to cargo (without
  # `default`), so Rustler's `cargo rustc -p exla_rs_nif --release` (mix compile's source build in
  # this checkout) relinked the library, 75 s, where it now finds it up to date.
  ordered=$(tr ' ' '\n' <<<"$nif_versions" | grep -v '^2\.16$' || true; grep -ow '2\.16' <<<"$nif_versions" || true)
  for nif in $ordered; do
    feature=nif_version_${nif/./_}
    name=libexla_rs_nif-v$version-nif-$nif-$target
    echo "=== NIF $nif ($feature)"
    start=$SECONDS
    if [[ $feature == nif_version_2_16 ]]; then
      grep -qx 'default = \["nif_version_2_16"\]' native/exla_rs/crates/exla-rs-nif/Cargo.toml ||
        { echo "release.sh: exla_rs_nif's default feature is no longer nif_version_2_16" >&2; exit 1; }
      features=()
    else
      features=(--no-default-features --features "$feature")
    fi
    cargo build --release --manifest-path "$CARGO_MANIFEST" -p exla_rs_nif "${features[@]}"
    cp native/exla_rs/target/release/libexla_rs_nif.so "$stage/$name.so"
    check_kernels "$stage/$name.so"
    pack "$stage" "$name.so" "$out/$name.so.tar.gz"
    sum=$(sha256sum "$out/$name.so.tar.gz" | cut -d' ' -f1)
    checksums+=("  \"$name.so.tar.gz\" => \"sha256:$sum\",")
    echo "  $name.so.tar.gz: $(stat -c %s "$out/$name.so.tar.gz") bytes (library $(stat -c %s "$stage/$name.so")), built in $((SECONDS - start)) s"
  done
  # The format RustlerPrecompiled writes and reads (an Elixir map, sorted by file name).
  printf '%%{\n%s\n}\n' "$(printf '%s\n' "${checksums[@]}" | sort)" >"$out/checksum-Elixir.ExlaRs.NIF.exs"
}
if ((artifacts)); then
  build_artifacts
elif [[ ! -f $out/checksum-Elixir.ExlaRs.NIF.exs ]]; then
  echo "release.sh: --package-only needs $out/checksum-Elixir.ExlaRs.NIF.exs from an earlier run" >&2
  exit 1
fi
echo "=== $out/checksum-Elixir.ExlaRs.NIF.exs"
cat "$out/checksum-Elixir.ExlaRs.NIF.exs"

((package)) || exit 0

# The Hex package, built from the tracked files (as committed or modified, never untracked or
# ignored ones) plus the checksum file, in a staging copy: the checkout itself keeps no checksum
# file, so it goes on building its NIF from source.
echo "=== Hex package"
pkg=$out/package
rm -rf "$pkg" && mkdir -p "$pkg"
git ls-files -z | tar --null -T - -cf - | tar -C "$pkg" -xf -
cp "$out/checksum-Elixir.ExlaRs.NIF.exs" "$pkg/"
source scripts/elixir.sh
exla_rs_elixir
# Hex packages take their dependencies from hex.pm: no local path overrides here.
for v in $(compgen -e | grep '^EXLA_RS_.*_PATH$'); do unset "$v"; done
(cd "$pkg" && MIX_ENV=prod mix hex.build --output "$out/exla_rs-$version.tar")
echo "package: $out/exla_rs-$version.tar ($(stat -c %s "$out/exla_rs-$version.tar") bytes); publish from $pkg"
