# Sourced by the peer benchmarks: sets $venv to a virtual environment outside the repo
# ($REGFLOW_PEERS_VENV, default /tmp/regflow-peers/venv) holding the Python packages named
# as arguments ("jax" installs jax[cpu]); a package that fails to install is left out, and
# the benchmark then prints regflow's figures without that peer.
venv="${REGFLOW_PEERS_VENV:-/tmp/regflow-peers/venv}"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip
fi
for package in "$@"; do
  spec=$package
  [ "$package" = jax ] && spec="jax[cpu]"
  "$venv/bin/python" -c "import $package" 2>/dev/null || "$venv/bin/pip" install -q "$spec" || true
done
