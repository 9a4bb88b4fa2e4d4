# Sourced by the scripts that run Mix: puts an Elixir >= 1.17 with Hex on PATH and makes Nx,
# EXLA's Elixir side and Axon resolvable as the project's (optional) Mix dependencies.
#
# 1. The offline toolchain beside the checkout (../shared/toolchain, or $EXLA_RS_TOOLCHAIN):
#    Elixir 1.18.4 for OTP 25, the Hex archive, and source trees of Nx 0.13.1, complex,
#    telemetry, Polaris, Axon 0.8.1, a stand-in for EXLA's Elixir side, and Bumblebee 0.7.0
#    with its dependency tree. mix.exs turns each into a path dependency through
#    EXLA_RS_<APP>_PATH. Nothing is copied into the repository (tokenizers, which writes into
#    its own folder when compiled, is copied into the ignored .mix/).
# 2. Otherwise an `elixir` >= 1.17 on PATH with Hex installed; the dependencies then come from
#    hex.pm (`mix deps.get`).
# Returns non-zero, saying what is missing, when neither is there.
exla_rs_elixir() {
  local root=${EXLA_RS_ROOT:?source scripts/env.sh first}
  local tc=${EXLA_RS_TOOLCHAIN:-$root/../shared/toolchain}
  # Mix and Hex state of our own, inside the (ignored) .mix/: never the user's ~/.mix.
  export MIX_HOME=${EXLA_RS_MIX_HOME:-$root/.mix} HEX_HOME=${EXLA_RS_MIX_HOME:-$root/.mix}/hex
  if [[ -x $tc/elixir/bin/elixir && -d $tc/deps/nx ]]; then
    tc=$(cd "$tc" && pwd)
    export PATH=$tc/elixir/bin:$PATH HEX_OFFLINE=1
    local app
    for app in nx exla axon complex telemetry polaris \
      bumblebee rustler_precompiled rustler castore nx_image unpickler safetensors jason unzip \
      progress_bar decimal nx_signal; do
      [[ -d $tc/deps/$app ]] && export "EXLA_RS_${app^^}_PATH=$tc/deps/$app"
    done
    # Tokenizers (Bumblebee's) compiles its NIF into its own folder: build it from a writable
    # copy inside the ignored .mix/, never in the toolchain. No precompiled NIF offline, so
    # cargo builds the crate (TOKENIZERS_BUILD).
    if [[ -d $tc/deps/tokenizers ]]; then
      local copy=$MIX_HOME/writable/tokenizers stamp
      stamp=$(cd "$tc/deps/tokenizers" && find . -path ./native/ex_tokenizers/target -prune -o -type f -print0 |
        sort -z | xargs -0 cksum | cksum)
      if [[ ! -f $copy/.exla_rs_stamp || $(cat "$copy/.exla_rs_stamp") != "$stamp" ]]; then
        rm -rf "$copy" && mkdir -p "$(dirname "$copy")" &&
          cp -r "$tc/deps/tokenizers" "$copy" && chmod -R u+w "$copy" &&
          echo "$stamp" >"$copy/.exla_rs_stamp" || return 1
      fi
      export EXLA_RS_TOKENIZERS_PATH=$copy TOKENIZERS_BUILD=true
    fi
    # Packaging and docs: RustlerPrecompiled (+ castore), Rustler (+ jason) for source builds,
    # ExDoc and its deps. earmark_parser writes src/*.erl into its own folder when compiled, so
    # it gets a writable copy outside the repository.
    for app in rustler_precompiled castore rustler jason ex_doc makeup makeup_elixir makeup_erlang nimble_parsec; do
      [[ -d $tc/deps/$app ]] && export "EXLA_RS_${app^^}_PATH=$tc/deps/$app"
    done
    if [[ -d $tc/deps/earmark_parser ]]; then
      local rw=${XDG_CACHE_HOME:-$HOME/.cache}/exla_rs/toolchain-rw
      if [[ ! -f $rw/earmark_parser/mix.exs ]]; then
        mkdir -p "$rw" && cp -r "$tc/deps/earmark_parser" "$rw/" && chmod -R u+w "$rw/earmark_parser" || return 1
      fi
      export EXLA_RS_EARMARK_PARSER_PATH=$rw/earmark_parser
    fi
    if ! compgen -G "$MIX_HOME/archives/hex-*" >/dev/null; then
      mix archive.install --force "$(ls "$tc"/hex-*.ez | head -n 1)" >/dev/null || return 1
    fi
    export EXLA_RS_ELIXIR_FROM=toolchain
    return 0
  fi
  if command -v elixir >/dev/null 2>&1 &&
    elixir -e 'System.halt(if Version.match?(System.version(), ">= 1.17.0"), do: 0, else: 1)' 2>/dev/null; then
    if ! mix hex.info >/dev/null 2>&1; then
      echo "exla_rs: Elixir $(elixir -e 'IO.write System.version()') has no Hex: run 'mix local.hex'" >&2
      return 1
    fi
    export EXLA_RS_ELIXIR_FROM=path
    return 0
  fi
  cat >&2 <<MSG
exla_rs: no Elixir >= 1.17 with Hex found. Nx and EXLA need Elixir >= 1.17 (Debian 12's is 1.14).
Either put the offline toolchain at $tc (or set EXLA_RS_TOOLCHAIN): Elixir 1.18 for OTP 25,
hex-*.ez and deps/{nx,complex,telemetry,exla,polaris,axon}; or install Elixir >= 1.17 on PATH
and run 'mix local.hex' (the dependencies then come from hex.pm).
MSG
  return 1
}
