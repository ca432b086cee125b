# The campaign's set-up on a bare GPU machine (tools/campaign/README.md), before any Python of
# the project runs: sourced by run.sh's `campaign` case, before it picks a Python (it uses
# run.sh's ROOT, say and deps_import). The pure-Python wheels the image's python3 lacks come
# carried in .whl/, Fashion-MNIST in .fmnist/ and the k-NN's baseline in .baselines/
# (tools/campaign/carry.sh makes them), the last call's report in .campaign_report/ (the caller
# copies it there); the call's clock starts here, set-up included.
export RESMLP_CAMPAIGN_STARTED="${RESMLP_CAMPAIGN_STARTED:-$(date +%s)}"
campaign_wheels() {
  local py="${RESMLP_PYTHON:-python3}" site="${TMPDIR:-/tmp}/resmlp-wheels"
  [ -d "$ROOT/.whl" ] && ! deps_import "$py" || return 0
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  deps_import "$py" || "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" "$ROOT"/.whl/*.whl >&2 || { say "could not install .whl/*.whl into $site with $py"; exit 2; }
}
campaign_wheels
if ls "$ROOT"/.fmnist/*-ubyte.gz >/dev/null 2>&1; then
  export RESMLP_FMNIST_SEARCH="$ROOT/.fmnist${RESMLP_FMNIST_SEARCH:+:$RESMLP_FMNIST_SEARCH}"
fi
