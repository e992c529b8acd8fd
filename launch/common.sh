# Shared argument parsing, input checks and launch for the recipes in this directory. Sourced by
# them (it is not a command); each recipe sets RECIPE, ABOUT and its defaults (GPUS, PORT, MODE,
# MODE_CHOICES, PROVIDER), calls prepare, adds its own variables, then launch_sglang / launch_vllm.
#
# Every recipe sets the whole SGLANG_MORI_* recipe explicitly, so a variable left in the caller's
# environment cannot silently change a run, and it prints (--dry-run) or runs exactly one command.

PYTHON=${PYTHON:-python3}
# The checkout this directory belongs to: its mori_sglang/env.py holds the values the options accept.
CHECKOUT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
MODEL=""
COMBINE_DTYPE=${SGLANG_MORI_COMBINE_DTYPE:-bf16}
DISPATCH_DTYPE=auto
MAX_DISPATCH_TOKENS=4096
HOST=127.0.0.1
SEED=1
DRY_RUN=0
EXTRA_ARGS=()
EXPORTED=()
RECIPE_FLAGS=()

die() {
    printf 'error: %s\n' "$*" >&2
    exit 1
}

usage_error() {
    printf 'error: %s\n\n' "$*" >&2
    usage >&2
    exit 2
}

usage() {
    cat <<USAGE
Usage: $0 --model PATH [--combine-dtype DTYPE] [options] [-- SERVER_ARGS...]

$ABOUT

Options:
  --model PATH              local Hugging Face model directory (required; must hold config.json)
  --combine-dtype DTYPE     ${COMBINE_CHOICES[*]} (default: \$SGLANG_MORI_COMBINE_DTYPE, else bf16)
  --dispatch-dtype DTYPE    ${DISPATCH_CHOICES[*]} (default: $DISPATCH_DTYPE)
  --provider NAME           ${PROVIDER_CHOICES[*]}: SGLANG_MORI_BACKEND (default: $PROVIDER)
  --mode MODE               ${MODE_CHOICES[*]} (default: $MODE)
  --gpus N                  GPUs = EP size = DP size, at least 2 (default: $GPUS)
  --max-dispatch-tokens N   SGLANG_MORI_NUM_MAX_DISPATCH_TOKENS_PER_RANK (default: $MAX_DISPATCH_TOKENS)
  --host HOST               (default: $HOST)
  --port PORT               (default: $PORT)
  --seed N                  server random seed (default: $SEED)
  --dry-run                 check the inputs, print the environment and the command, start nothing
                            (works without GPUs: with no GPU tool on PATH the GPU check is skipped)
  -h, --help                this text
  -- ARGS...                passed to the server unchanged, except flags the recipe sets itself
Options take their value as --option VALUE or --option=VALUE.
Environment: PYTHON (default python3) is the interpreter that runs the server; python3 on PATH reads
the accepted dtypes and providers from this checkout's mori_sglang/env.py.
USAGE
}

# Sets COMBINE_CHOICES, DISPATCH_CHOICES and PROVIDER_CHOICES to the values mori_sglang/env.py accepts
# for SGLANG_MORI_COMBINE_DTYPE, SGLANG_MORI_DISPATCH_DTYPE and SGLANG_MORI_BACKEND (the wire-format
# table's names). python3 on PATH reads them from this checkout, importing neither torch nor a
# framework, so a dry run needs no GPU and no installed mori_sglang; the server's PYTHON checks the
# exported values again before it starts.
read_choices() {
    local table
    # Run from the checkout: -m puts the working directory first on the module path.
    table=$(cd "$CHECKOUT" && python3 -B -m mori_sglang.env --choices \
        SGLANG_MORI_COMBINE_DTYPE SGLANG_MORI_DISPATCH_DTYPE SGLANG_MORI_BACKEND) ||
        die "python3 on PATH cannot read the accepted values from $CHECKOUT/mori_sglang/env.py"
    { read -ra COMBINE_CHOICES && read -ra DISPATCH_CHOICES && read -ra PROVIDER_CHOICES; } <<<"$table" ||
        die "mori_sglang/env.py --choices printed too few lines: $table"
}

one_of() {  # one_of FLAG VALUE CHOICE...
    local flag=$1 value=$2 choice
    shift 2
    for choice in "$@"; do
        [[ $value == "$choice" ]] && return 0
    done
    usage_error "$flag '$value' is not accepted; use one of: $*"
}

# The largest SGLANG_MORI_NUM_MAX_DISPATCH_TOKENS_PER_RANK accepts (mori_sglang/env.py's MAX_TOKENS_PER_RANK).
MAX_TOKENS_PER_RANK=1048576

positive_int() {  # positive_int FLAG VALUE [MAX]: at most 10 digits, so bash's arithmetic cannot wrap
    [[ $2 =~ ^[1-9][0-9]{0,9}$ ]] && ((10#$2 <= ${3:-4294967295})) ||
        usage_error "$1 '$2' is not a positive integer${3:+ up to $3}"
}

tcp_port() {  # tcp_port FLAG VALUE
    [[ $2 =~ ^[1-9][0-9]{0,4}$ ]] && ((10#$2 <= 65535)) || usage_error "$1 '$2' is not a TCP port (1 to 65535)"
}

parse_args() {
    while (($#)); do
        if [[ $1 == --*=* && $1 != --=* ]]; then  # --option=VALUE is --option VALUE
            set -- "${1%%=*}" "${1#*=}" "${@:2}"
            [[ -n $2 ]] || usage_error "$1 needs a value"
        fi
        case $1 in
            -h | --help)
                usage
                exit 0
                ;;
            --dry-run)
                DRY_RUN=1
                shift
                continue
                ;;
            --)
                shift
                EXTRA_ARGS=("$@")
                break
                ;;
            --model | --combine-dtype | --dispatch-dtype | --provider | --mode | --gpus | --max-dispatch-tokens | \
                --host | --port | --seed)
                (($# >= 2)) && [[ $2 != --* ]] || usage_error "$1 needs a value"
                ;;
            *) usage_error "unknown argument '$1'" ;;
        esac
        case $1 in
            --model) MODEL=$2 ;;
            --combine-dtype) COMBINE_DTYPE=$2 ;;
            --dispatch-dtype) DISPATCH_DTYPE=$2 ;;
            --provider) PROVIDER=$2 ;;
            --mode) MODE=$2 ;;
            --gpus) GPUS=$2 ;;
            --max-dispatch-tokens) MAX_DISPATCH_TOKENS=$2 ;;
            --host) HOST=$2 ;;
            --port) PORT=$2 ;;
            --seed) SEED=$2 ;;
        esac
        shift 2
    done
    [[ -n $MODEL ]] || usage_error "--model is required"
    one_of --combine-dtype "$COMBINE_DTYPE" "${COMBINE_CHOICES[@]}"
    one_of --dispatch-dtype "$DISPATCH_DTYPE" "${DISPATCH_CHOICES[@]}"
    one_of --provider "$PROVIDER" "${PROVIDER_CHOICES[@]}"
    one_of --mode "$MODE" "${MODE_CHOICES[@]}"
    positive_int --gpus "$GPUS" 1024
    ((10#$GPUS >= 2)) || usage_error "--gpus '$GPUS' is below 2: the recipe runs expert parallelism over" \
        "--gpus GPUs, and on one GPU it dispatches nothing (the MoRI all-to-all never runs); use --gpus 2 or more"
    positive_int --max-dispatch-tokens "$MAX_DISPATCH_TOKENS" "$MAX_TOKENS_PER_RANK"
    tcp_port --port "$PORT"
    [[ -n $HOST ]] || usage_error "--host needs a value"
    [[ $SEED =~ ^[0-9]{1,10}$ ]] && ((10#$SEED <= 4294967295)) ||
        usage_error "--seed '$SEED' is not an integer from 0 to 4294967295"
}

check_model_dir() {
    [[ -e $MODEL ]] || die "model path '$MODEL' does not exist"
    [[ -d $MODEL ]] || die "model path '$MODEL' is not a directory"
    [[ -f $MODEL/config.json ]] ||
        die "model path '$MODEL' has no config.json; point --model at a downloaded Hugging Face model directory"
}

# Sets GPU_VENDOR (nvidia|amd), GPU_COUNT and GPU_SOURCE (how they were counted). A visible-devices
# variable narrows the count to the GPUs the server will actually see.
detect_gpus() {
    local listing pattern visible_var=CUDA_VISIBLE_DEVICES
    if command -v nvidia-smi >/dev/null 2>&1; then
        GPU_VENDOR=nvidia GPU_SOURCE="nvidia-smi -L" pattern='^GPU [0-9]'
        listing=$(nvidia-smi -L 2>&1) || die "nvidia-smi -L failed: $listing"
    elif command -v amd-smi >/dev/null 2>&1; then
        GPU_VENDOR=amd GPU_SOURCE="amd-smi list" pattern='^GPU: *[0-9]' visible_var=HIP_VISIBLE_DEVICES
        listing=$(amd-smi list 2>&1) || die "amd-smi list failed: $listing"
    elif command -v rocm-smi >/dev/null 2>&1; then
        GPU_VENDOR=amd GPU_SOURCE="rocm-smi --showid --csv" pattern='^card[0-9]' visible_var=HIP_VISIBLE_DEVICES
        listing=$(rocm-smi --showid --csv 2>&1) || die "rocm-smi failed: $listing"
    elif ((DRY_RUN)); then
        GPU_VENDOR=unknown GPU_COUNT=0 GPU_SOURCE="no GPU tool on PATH"
        return 0
    else
        die "no GPU tool found: none of nvidia-smi, amd-smi or rocm-smi is on PATH"
    fi
    GPU_COUNT=$(grep -c "$pattern" <<<"$listing" || true)
    local visible=${!visible_var:-} ids
    if [[ -n $visible ]]; then
        IFS=, read -ra ids <<<"$visible"
        if ((${#ids[@]} < GPU_COUNT)); then
            GPU_COUNT=${#ids[@]}
        fi
        GPU_SOURCE+=", $visible_var=$visible"
    fi
}

check_gpus() {  # check_gpus VENDOR(any|nvidia|amd); a dry run without a GPU tool checks nothing
    detect_gpus
    [[ $GPU_VENDOR != unknown ]] || return 0
    [[ $1 == any || $1 == "$GPU_VENDOR" ]] || die "this recipe is for $1 GPUs; found $GPU_VENDOR ($GPU_SOURCE)"
    ((GPU_COUNT >= GPUS)) || die "this recipe needs $GPUS GPUs; found $GPU_COUNT ($GPU_SOURCE)"
}

export_env() {  # export_env NAME VALUE: export it and list it in the dry run
    export "$1=$2"
    EXPORTED+=("$1")
}

# The variables every recipe sets: the MoRI-backend knobs, and NVLink multicast off (multicast
# objects fail on shared or virtualised GPUs, and nothing here needs them).
export_mori_env() {  # export_mori_env SPLIT(0|1)
    export_env NCCL_NVLS_ENABLE 0
    export_env TORCH_SYMM_MEM_DISABLE_MULTICAST 1
    export_env SGLANG_MORI_COMBINE_DTYPE "$COMBINE_DTYPE"
    export_env SGLANG_MORI_DISPATCH_DTYPE "$DISPATCH_DTYPE"
    export_env SGLANG_MORI_SPLIT_DISPATCH_COMBINE "$1"
    export_env SGLANG_MORI_NUM_MAX_DISPATCH_TOKENS_PER_RANK "$MAX_DISPATCH_TOKENS"
    export_env SGLANG_MORI_BACKEND "$PROVIDER"
}

# prepare VENDOR(any|nvidia|amd) SPLIT(0|1) ARGS...: parse the arguments, check the model and the
# GPUs, and export the recipe's variables. SPLIT=1 splits the normal mode's dispatch and combine; the
# low-latency mode runs both directions low-latency already, so there it exports 0.
prepare() {
    local vendor=$1 split=$2
    shift 2
    read_choices
    parse_args "$@"
    check_model_dir
    check_gpus "$vendor"
    [[ $MODE != low_latency ]] || split=0
    export_mori_env "$split"
}

# refuse_overrides COMMAND...: an argument after -- that names a flag the recipe's command sets (FLAG
# or FLAG=VALUE, one of the server's aliases for it, or a prefix its parser would expand) would
# silently replace the recipe's value; refuse it, naming the recipe's value and the script option that
# sets it. RECIPE_FLAGS holds ALIAS=OPTION:FLAG entries: FLAG as the command spells it, the script
# OPTION that sets it ("-" where the recipe fixes it); a flag of the command with no entry is fixed.
# An ALIAS that undoes a switch of the command (vLLM's --disable-expert-parallel) names that switch
# as its FLAG: a switch has no value to agree with, so the ALIAS is refused whatever its value.
# (SGLang refuses a --dp-size of replicas next to the recipe's --attn-dp-size itself, by name.)
refuse_overrides() {
    local recipe_args=$(($# - ${#EXTRA_ARGS[@]})) i arg name value given entry flag own
    local -a entries=("${RECIPE_FLAGS[@]}") recipe=("${@:1:recipe_args}")
    for ((i = 0; i + 1 < ${#recipe[@]}; i++)); do  # the command's flags that take a value
        [[ ${recipe[i]} == -* && ${recipe[i + 1]} != -* ]] && entries+=("${recipe[i]}=-:${recipe[i]}")
    done
    for ((i = 0; i < ${#EXTRA_ARGS[@]}; i++)); do
        arg=${EXTRA_ARGS[i]} name=${EXTRA_ARGS[i]%%=*} value=""
        [[ $name == -* ]] || continue
        if [[ $arg == *=* ]]; then
            value=${arg#*=}
        elif ((i + 1 < ${#EXTRA_ARGS[@]})) && [[ ${EXTRA_ARGS[i + 1]} != -* ]]; then
            value=${EXTRA_ARGS[i + 1]}
        fi
        given=$arg${value:+ $value}
        [[ $arg == *=* ]] && given=$arg
        for entry in "${entries[@]}"; do
            flag=${entry%%=*} own=${entry#*=}
            own=${own%%:*}
            # The servers' parsers also take an unambiguous prefix of a long option (--tp for --tp-size).
            [[ $name == "$flag" || ($name == --* && ${#name} -ge 4 && $flag == "$name"*) ]] || continue
            flag=${entry##*:}
            [[ -n $value && $value == "$(command_value "$flag" "${recipe[@]}")" ]] && continue  # the same value
            refuse_override "$given" "$flag" "$own" "${recipe[@]}"
        done
    done
}

refuse_override() {  # refuse_override GIVEN FLAG OPTION COMMAND...: the one-sentence usage error
    local given=$1 flag=$2 own=$3 value
    shift 3
    value=$(command_value "$flag" "$@")
    if [[ $own == - ]]; then
        usage_sentence "'-- $given' contradicts the recipe, which runs ${flag}${value:+ $value}; this recipe does not change it"
    fi
    usage_sentence "'-- $given' contradicts the recipe, which runs ${flag}${value:+ $value}; set it with the script's $own option"
}

command_value() {  # command_value FLAG COMMAND...: the value that follows FLAG in COMMAND, if any
    local flag=$1
    shift
    while (($#)); do
        if [[ $1 == "$flag" ]]; then
            [[ ${2-} == -* ]] || printf '%s' "${2-}"
            return 0
        fi
        shift
    done
}

usage_sentence() {  # usage_sentence MESSAGE: a usage error in one sentence, without the usage text
    printf 'error: %s\n' "$*" >&2
    exit 2
}

# launch FRAMEWORK_MODULE COMMAND...: print the recipe (dry run), or check that the interpreter has
# the framework and mori_sglang, show the effective mori-sglang settings and exec the server.
launch() {
    local module=$1 name line
    shift
    refuse_overrides "$@"
    if ((DRY_RUN)); then
        printf '# %s\n' "$RECIPE"
        if [[ $GPU_VENDOR == unknown ]]; then
            printf '# GPUs not checked: none of nvidia-smi, amd-smi or rocm-smi is on PATH\n'
        fi
        for name in "${EXPORTED[@]}"; do
            printf 'export %s=%q\n' "$name" "${!name}"
        done
        printf -v line '%q ' "$@"
        printf '%s\n' "${line% }"
        exit 0
    fi
    for name in "$module" mori_sglang; do
        "$PYTHON" -c "import $name" >/dev/null 2>&1 ||
            die "'$PYTHON' cannot import $name; install it or set PYTHON to the interpreter that has it"
    done
    "$PYTHON" -m mori_sglang.env
    exec "$@"
}

launch_sglang() {  # launch_sglang SERVER_ARGS...
    RECIPE_FLAGS=(
        --model-path=--model:--model-path --model=--model:--model-path
        --tp-size=--gpus:--tp-size --tensor-parallel-size=--gpus:--tp-size
        --ep-size=--gpus:--ep-size --expert-parallel-size=--gpus:--ep-size --ep=--gpus:--ep-size
        --attn-dp-size=--gpus:--attn-dp-size --attention-data-parallel-size=--gpus:--attn-dp-size
        --moe-a2a-backend=-:--moe-a2a-backend --deepep-mode=--mode:--deepep-mode
        --random-seed=--seed:--random-seed --host=--host:--host --port=--port:--port
    )
    launch sglang "$PYTHON" -m sglang.launch_server --model-path "$MODEL" --trust-remote-code \
        --tp-size "$GPUS" --ep-size "$GPUS" --attn-dp-size "$GPUS" \
        --moe-a2a-backend mori --deepep-mode "$MODE" "$@" \
        --random-seed "$SEED" --host "$HOST" --port "$PORT" "${EXTRA_ARGS[@]}"
}

launch_vllm() {  # launch_vllm SERVER_ARGS...: vLLM's DP attention is TP 1 x DP N, EP over all of them
    RECIPE_FLAGS=(
        --model=--model:serve
        --tensor-parallel-size=-:--tensor-parallel-size -tp=-:--tensor-parallel-size
        --data-parallel-size=--gpus:--data-parallel-size -dp=--gpus:--data-parallel-size
        --disable-expert-parallel=-:--enable-expert-parallel --no-enable-expert-parallel=-:--enable-expert-parallel
        --all2all-backend=--mode:--all2all-backend --max-num-batched-tokens=--max-dispatch-tokens:--max-num-batched-tokens
        --seed=--seed:--seed --host=--host:--host --port=--port:--port
    )
    launch vllm "$PYTHON" -m vllm.entrypoints.cli.main serve "$MODEL" --trust-remote-code \
        --tensor-parallel-size 1 --data-parallel-size "$GPUS" --enable-expert-parallel \
        --all2all-backend "mori_$MODE" --max-num-batched-tokens "$MAX_DISPATCH_TOKENS" "$@" \
        --seed "$SEED" --host "$HOST" --port "$PORT" "${EXTRA_ARGS[@]}"
}
