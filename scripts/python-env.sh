# Sourced by the scripts: picks the Python interpreter everything is installed into and run with.
# $PYTHON, when set, is used as is (no virtual environment is created or touched). Otherwise a
# virtual environment under the user cache directory is used (created by scripts/setup.sh), so
# the system interpreter is never modified (PEP 668) and a fresh clone reuses installed packages.
FABRIC_LIB_VENV=${FABRIC_LIB_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/fabric-lib/venv}
if [ -n "${PYTHON:-}" ]; then
    PY=$PYTHON
else
    PY=$FABRIC_LIB_VENV/bin/python
fi
