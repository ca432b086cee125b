#!/usr/bin/env bash
# The one entry point: bash run.sh <command> [model | checkpoint] [key=value ...]
#   bash run.sh help            lists the commands and models
#   bash run.sh test            runs the test suite (what CI runs)
# Python environment, in this order: $RESMLP_PYTHON; an active virtualenv or conda env;
# a python3 that already imports torch, torchvision, timm, omegaconf and lightly (a
# cluster's own torch); else ./.venv, created on first use and re-installed only when
# requirements.txt or pyproject.toml change.
# Several GPUs or nodes: NPROC_PER_NODE=8 [NNODES=2 NODE_RANK=0 MASTER_ADDR=... MASTER_PORT=...]
#   or, with no fixed master (torchrun's c10d rendezvous, the same command on every node):
#   NPROC_PER_NODE=8 NNODES=2 RDZV_ENDPOINT=host:port [RDZV_ID=<job id>] [RDZV_TIMEOUT=seconds, 300]
# A SLURM job instead: bash run.sh dino resmlp_s12 launcher=slurm slurm.nodes=2 ... (docs/cluster.md)
# Paths on the command line mean what they mean in the caller's shell: the commands run in
# the caller's folder (default outputs, runs/..., land there), never in this one.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

say() { echo "run.sh: $*" >&2; }

# find_spec, not import: importing torch and lightly costs seconds on every call.
deps_import() {
  "$1" -c "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in
    ('torch', 'torchvision', 'timm', 'omegaconf', 'lightly')))" >/dev/null 2>&1
}

venv_python() {
  local venv="$ROOT/.venv" stamp
  stamp="$(cat "$ROOT/requirements.txt" "$ROOT/pyproject.toml" | sha256sum | cut -c1-16)"
  if [ ! -x "$venv/bin/python" ]; then
    say "creating $venv (first use)"
    python3 -m venv "$venv" || { say "could not create a virtualenv: install python3-venv, or activate an environment with torch"; exit 2; }
  fi
  if [ "$(cat "$venv/.resmlp-stamp" 2>/dev/null)" != "$stamp" ]; then
    say "installing requirements into $venv (only when requirements.txt or pyproject.toml change)"
    "$venv/bin/python" -m pip install -q --upgrade pip >&2
    "$venv/bin/python" -m pip install -q -r "$ROOT/requirements.txt" >&2
    "$venv/bin/python" -m pip install -q --no-deps -e "$ROOT" >&2
    echo "$stamp" > "$venv/.resmlp-stamp"
  fi
  PY="$venv/bin/python"
}

# An environment we did not build may lack this package: make `resmlp.*` importable
# without pip by a folder of links that mirrors pyproject.toml's package-dir map.
link_package() {
  "$PY" -c "import importlib.util as u, sys; sys.exit(u.find_spec('resmlp.core') is None)" >/dev/null 2>&1 && return
  local shim="$ROOT/.resmlp_path/resmlp"
  mkdir -p "$shim"
  for pair in core:core models:models data:data ssl:ssl eval:eval supervised:supervised; do
    ln -sfn "$ROOT/${pair#*:}" "$shim/${pair%%:*}"
  done
  export PYTHONPATH="$ROOT/.resmlp_path${PYTHONPATH:+:$PYTHONPATH}"
}

OWN_ENV=0  # 1: an environment we did not build (then run.sh installs nothing, not even data)
choose_python() {
  OWN_ENV=1
  if [ -n "${RESMLP_PYTHON:-}" ]; then PY="$RESMLP_PYTHON"
  elif [ -n "${VIRTUAL_ENV:-}" ] && [ "$VIRTUAL_ENV" != "$ROOT/.venv" ] && [ -x "$VIRTUAL_ENV/bin/python" ]; then PY="$VIRTUAL_ENV/bin/python"
  elif [ -n "${CONDA_PREFIX:-}" ] && [ -x "$CONDA_PREFIX/bin/python" ]; then PY="$CONDA_PREFIX/bin/python"
  elif command -v python3 >/dev/null && deps_import python3; then PY="$(command -v python3)"
  else OWN_ENV=0; venv_python; return
  fi
  deps_import "$PY" || { say "$PY lacks torch/torchvision/timm/omegaconf/lightly: pip install -r requirements.txt there, or deactivate it to let run.sh build .venv"; exit 2; }
  link_package
}

# The default dataset: when it is nowhere and we may install packages, install Debian's copy.
# Never on a machine whose environment is the user's own (RESMLP_PYTHON, an active venv or
# conda env, a python3 with the packages): a cluster node or an offline GPU box.
ensure_fashion_mnist() {
  case "$*" in *data=*|*data.root=*) return ;; esac
  [ "$OWN_ENV" = 1 ] && return
  [ -n "${RESMLP_FMNIST_SEARCH+x}" ] && return  # the user names the folders data/fashion_mnist.py searches
  [ -d /usr/share/datasets/fashion-mnist ] && return
  [ -d "${RESMLP_DATA_DIR:-$HOME/.cache/resmlp/datasets}/FashionMNIST" ] && return
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    say "Fashion-MNIST not found: installing Debian's dataset-fashion-mnist"
    { apt-get install -y -q dataset-fashion-mnist || { apt-get update -q && apt-get install -y -q dataset-fashion-mnist; }; } >&2 \
      || say "could not install dataset-fashion-mnist; the command will say how else to provide the data"
  fi
}

# OpenMP threads that spin while waiting steal the cores from data-loader workers and
# other processes: on a busy 2-core machine a CPU DINO step ran 4x slower. Sleep instead.
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"

cmd="${1:-help}"
case "$cmd" in
  help|-h|--help)
    choose_python; "$PY" -m resmlp.core.cli help
    # run.sh's own: tools of this repository for measuring it, not commands of the package
    cat <<'EOF'

run.sh also runs (tools of this repository in tools/, not of the installed package):
  bench <model>            GPU/CPU throughput benchmarks (tools/bench/NOTES.md)
  campaign                 this project's GPU measurement, one resumable call after another (tools/campaign/README.md)
  campaign-carry           make .whl/, .fmnist/ and .baselines/: what a bare GPU machine needs for campaign
EOF
    exit 0 ;;
  campaign) . "$ROOT/tools/campaign/setup.sh" ;;   # before a Python is picked: it may install the carried wheels
  campaign-carry) shift; exec bash "$ROOT/tools/campaign/carry.sh" "$@" ;;
  test)
    shift; choose_python
    ensure_fashion_mnist
    # the whole suite, unless the arguments name test files or folders themselves; pytest runs
    # in the repository (its settings, tests/), so a file named from the caller's folder goes
    # by its absolute path
    where=tests; args=()
    for a in "$@"; do
      case "$a" in -*) ;; *)
        if [ -e "${a%%::*}" ]; then where=; case "$a" in /*) ;; *) a="$PWD/$a" ;; esac
        elif [ -e "$ROOT/${a%%::*}" ]; then where=; fi ;;
      esac
      args+=("$a")
    done
    cd "$ROOT"
    set +e; "$PY" -m pytest $where -q ${args[@]+"${args[@]}"}; rc=$?; set -e
    [ "$rc" = 5 ] && { say "pytest collected no tests"; exit 1; }
    exit "$rc" ;;
esac

choose_python
case "$cmd" in dino|knn|linear|viz|supervised|distill|finetune|compare|data) ensure_fashion_mnist "$@" ;; esac
# python -m would put the caller's folder first on the import path: a file of theirs named
# like a module (yaml.py, a datasets/ package) must not replace it.
export PYTHONSAFEPATH=1
if [ "$cmd" = bench ] || [ "$cmd" = campaign ]; then
  # tools for measuring this project, not commands of the package: they live in tools/
  shift; export PYTHONPATH="$ROOT/tools${PYTHONPATH:+:$PYTHONPATH}"
  exec "$PY" -m "$cmd" "$@"
fi

NPROC="${NPROC_PER_NODE:-1}"; NNODES="${NNODES:-1}"
case "$NPROC$NNODES" in *[!0-9]*) say "NPROC_PER_NODE and NNODES must be whole numbers (got '$NPROC', '$NNODES')"; exit 2 ;; esac
if [ "$NPROC" -gt 1 ] || [ "$NNODES" -gt 1 ]; then
  # One line here, not torchrun's usage text, a traceback or a rendezvous that never answers:
  # GPUs per process, ports, hosts, and the rendezvous host waited for RDZV_TIMEOUT seconds,
  # torchrun's time for every node to join too (resmlp/core/launch.py).
  export RDZV_TIMEOUT="${RDZV_TIMEOUT:-300}"
  "$PY" -m resmlp.core.launch "$@" || exit 2
fi
if { [ "$NPROC" -gt 1 ] || [ "$NNODES" -gt 1 ]; } && [ -n "${RDZV_ENDPOINT:-}" ]; then
  # Ranks are handed out as the nodes arrive at host:port (one of them, or any reachable
  # host, serves the rendezvous); RDZV_ID keeps two jobs on one endpoint apart.
  exec "$PY" -m torch.distributed.run --nproc_per_node="$NPROC" --nnodes="$NNODES" \
    --rdzv_backend=c10d --rdzv_endpoint="$RDZV_ENDPOINT" --rdzv_id="${RDZV_ID:-resmlp}" \
    --rdzv_conf=join_timeout="$RDZV_TIMEOUT" -m resmlp.core.cli "$@"
fi
if [ "$NPROC" -gt 1 ] || [ "$NNODES" -gt 1 ]; then
  exec "$PY" -m torch.distributed.run --nproc_per_node="$NPROC" --nnodes="$NNODES" \
    --node_rank="${NODE_RANK:-0}" --master_addr="${MASTER_ADDR:-127.0.0.1}" \
    --master_port="${MASTER_PORT:-29500}" -m resmlp.core.cli "$@"
fi
exec "$PY" -m resmlp.core.cli "$@"
