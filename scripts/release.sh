#!/usr/bin/env bash
# Builds a release of exla_rs: the precompiled NIFs RustlerPrecompiled downloads, their checksum
# file, and the Hex package.
#
#   scripts/release.sh [--out DIR] [--nif-versions "2.15 2.16 2.17"] [--no-package]
#
# Writes into DIR (default _release/v<version>, ignored by git):
#   libexla_rs_nif-v<version>-nif-<N>-x86_64-unknown-linux-gnu.so.tar.gz   one per NIF version
#   checksum-Elixir.ExlaRs.NIF.exs     sha256 of each, the file the Hex package ships
#   exla_rs-<version>.tar              the Hex package (mix hex.build), checksum file included
#
# Publish: upload the .tar.gz files to the release's base URL (the GitHub release v<version>,
# or a mirror), then `mix hex.publish package` from the staging copy printed at the end.
#
# Every artifact embeds every CUDA kernel (sm_80, sm_86, sm_89, sm_90 and sm_90a machine code,
# compute_90 PTX), so one file serves CPU-only and GPU machines: nvcc is required (scripts/env.sh
# finds the pip nvcc setup.sh installs), and the script refuses an artifact without them.
# Only x86_64-unknown-linux-gnu is built; see docs/getting-started.md for the other targets.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
source scripts/env.sh

nif_versions="2.15 2.16 2.17"
out=""
package=1
while (($#)); do
  case $1 in
    --out) out=$2; shift 2 ;;
    --nif-versions) nif_versions=$2; shift 2 ;;
    --no-package) package=0; shift ;;
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

# check_kernels SO: every cubin and the PTX the default architecture list asks for is inside.
check_kernels() {
  local elf ptx want
  elf=$("$cuobjdump" --list-elf "$1" 2>/dev/null || true)
  ptx=$("$cuobjdump" --list-ptx "$1" 2>/dev/null || true)
  for want in sm_80 sm_86 sm_89 sm_90 sm_90a; do
    grep -q "\.$want\.cubin" <<<"$elf" || { echo "release.sh: $1 has no $want cubin" >&2; return 1; }
  done
  grep -q "\.sm_90\.ptx" <<<"$ptx" || { echo "release.sh: $1 has no compute_90 PTX" >&2; return 1; }
  echo "  kernels: $(grep -c cubin <<<"$elf") cubins ($(grep -o 'sm_[0-9a]*\.cubin' <<<"$elf" | sort -u | tr '\n' ' ')), $(grep -c ptx <<<"$ptx") PTX"
}

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
checksums=()
for nif in $nif_versions; do
  feature=nif_version_${nif/./_}
  name=libexla_rs_nif-v$version-nif-$nif-$target
  echo "=== NIF $nif ($feature)"
  start=$SECONDS
  cargo build --release --manifest-path "$CARGO_MANIFEST" -p exla_rs_nif --no-default-features --features "$feature"
  cp native/exla_rs/target/release/libexla_rs_nif.so "$stage/$name.so"
  check_kernels "$stage/$name.so"
  pack "$stage" "$name.so" "$out/$name.so.tar.gz"
  sum=$(sha256sum "$out/$name.so.tar.gz" | cut -d' ' -f1)
  checksums+=("  \"$name.so.tar.gz\" => \"sha256:$sum\",")
  echo "  $name.so.tar.gz: $(stat -c %s "$out/$name.so.tar.gz") bytes (library $(stat -c %s "$stage/$name.so")), built in $((SECONDS - start)) s"
done
# The format RustlerPrecompiled writes and reads (an Elixir map, sorted by file name).
printf '%%{\n%s\n}\n' "$(printf '%s\n' "${checksums[@]}" | sort)" >"$out/checksum-Elixir.ExlaRs.NIF.exs"
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
