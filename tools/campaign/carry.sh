#!/usr/bin/env bash
# What a bare GPU machine needs for the campaign (tools/campaign/README.md), made here, online:
#   bash tools/campaign/carry.sh [<commit>]      (bash run.sh campaign-carry runs it)
#   bash tools/campaign/carry.sh --which [<commit>]   prints the baseline's path, writes nothing
# .whl/: the pure-Python wheels the GPU image lacks; .fmnist/: the four Fashion-MNIST files;
# .baselines/knn_search_<commit>.py: eval/knn_search.py as <commit> had it, the k-NN's
# baseline (campaign.<profile>.knn_baseline). <commit> defaults to the one campaign.yaml's
# gpu profile names. The machine gets them by
# `carry: [".whl", ".fmnist", ".baselines", ".campaign_report"]` (all ignored by git; about 30 MB).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
say() { echo "carry.sh: $*" >&2; }

which=0; [ "${1:-}" = --which ] && { which=1; shift; }
commit="${1:-$(sed -n 's|^ *knn_baseline: \.baselines/knn_search_\([0-9a-f]*\)\.py.*|\1|p' "$HERE/campaign.yaml" | head -1)}"
[ -n "$commit" ] || { say "campaign.yaml names no .baselines/knn_search_<commit>.py: give the commit"; exit 2; }
[ "$which" = 1 ] && { echo ".baselines/knn_search_$commit.py"; exit 0; }
mkdir -p "$ROOT/.whl" "$ROOT/.fmnist" "$ROOT/.baselines"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$ROOT/.whl" omegaconf==2.3.1 lightly==1.6.0
python3 -m pip wheel -q --no-deps -w "$ROOT/.whl" antlr4-python3-runtime==4.9.3  # an sdist on PyPI: pure Python
fmnist="${RESMLP_FMNIST_DIR:-/usr/share/datasets/fashion-mnist}"
cp "$fmnist"/*-ubyte.gz "$ROOT/.fmnist/" || { say "no Fashion-MNIST .gz files in $fmnist: set RESMLP_FMNIST_DIR"; exit 2; }
baseline="$ROOT/.baselines/knn_search_$commit.py"
git -C "$ROOT" show "$commit:eval/knn_search.py" >"$baseline.tmp" \
  || { rm -f "$baseline.tmp"
       say "git cannot show $commit:eval/knn_search.py: run it in a clone with its history"; exit 2; }
mv "$baseline.tmp" "$baseline"
ls -l "$ROOT/.whl" "$ROOT/.fmnist" "$ROOT/.baselines" >&2
