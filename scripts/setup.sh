#!/usr/bin/env bash
# Creates a virtual environment with Python >= 3.12 and installs flashjax into it (editable).
#
# Usage: bash scripts/setup.sh [--latest] [extras]
#   extras    comma-separated: test, dev, gpu (default none). Where `nvidia-smi -L` succeeds
#             (an NVIDIA GPU with its driver) gpu is added: JAX's CUDA 13 plugin.
#   default   .venv with the JAX/Flax pinned in constraints.txt. If a Python found here already
#             has exactly those versions (and, on a GPU machine, the CUDA plugin), .venv reuses
#             its packages through a .pth file and JAX/Flax are not downloaded (machines without
#             a network); what the extras need and it lacks is installed where pip can reach an
#             index, else listed.
#   --latest  .venv-latest with the newest JAX/Flax that pip resolves inside pyproject's ranges.
# The Python: $FLASHJAX_PYTHON if set; else the first >= 3.12 of python3.12, python3.13,
# python3.14, python3, python on PATH and pyenv's installed versions, preferring one that
# already has the pinned JAX. Ends by printing the versions and JAX's default backend.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

latest=0
if [ "${1:-}" = "--latest" ]; then latest=1; shift; fi
extras="${1:-}"
venv=.venv
[ "$latest" = 1 ] && venv=.venv-latest

gpu=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  gpu=1
  case ",$extras," in *,gpu,*) ;; *) extras="${extras:+$extras,}gpu" ;; esac
fi
spec="."
[ -n "$extras" ] && spec=".[$extras]"

# pip inside the venv, its messages (errors included) shown and its exit status kept; only a
# harmless notice about a pip configuration naming absent index directories is dropped.
venv_pip() {
  "$venv/bin/python" -m pip --disable-pip-version-check "$@" 2>&1 \
    | { grep -v "^WARNING: Location '.*' is ignored: it is neither a file nor a directory" || true; }
}

# Candidate interpreters, one path a line: $FLASHJAX_PYTHON, else PATH, then pyenv's versions.
find_pythons() {
  if [ -n "${FLASHJAX_PYTHON:-}" ]; then command -v "$FLASHJAX_PYTHON" || true; return; fi
  local name version
  for name in python3.12 python3.13 python3.14 python3 python; do
    command -v "$name" || true
  done
  if command -v pyenv >/dev/null; then
    for version in $(pyenv versions --bare 2>/dev/null); do
      PYENV_VERSION="$version" pyenv which python3 2>/dev/null || true
    done
  fi
}

# Exit status 0 when this interpreter has the versions pinned in constraints.txt (and with a
# GPU, argv[1] == "1", JAX's CUDA plugin of the same release).
HAS_PINS='
import importlib.metadata as md, sys
pins = {}
for line in open("constraints.txt"):
    line = line.split("#")[0].strip()
    if "==" in line:
        name, version = line.split("==")
        pins[name.strip().lower()] = version.strip()
if sys.argv[1] == "1":
    pins["jax-cuda13-plugin"] = pins["jax-cuda13-pjrt"] = pins["jaxlib"]
try:
    sys.exit(any(md.version(name) != version for name, version in pins.items()))
except md.PackageNotFoundError:
    sys.exit(1)
'

# One line per site-packages directory of this interpreter: .pth lines that add them (with
# their own .pth files) to the venv's sys.path, after the venv's own packages.
BASE_SITE_PTH='
import os, site
dirs = site.getsitepackages() + ([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])
seen = set()
for d in dirs:
    if os.path.isdir(d) and os.path.realpath(d) not in seen:
        seen.add(os.path.realpath(d))
        print(f"import site; site.addsitedir({d!r})")
'

if [ ! -x "$venv/bin/python" ]; then
  py="" reuse=""
  while IFS= read -r candidate; do
    "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 12))' </dev/null 2>/dev/null || continue
    [ -n "$py" ] || py="$candidate"
    if [ "$latest" = 0 ] && "$candidate" -c "$HAS_PINS" "$gpu" </dev/null 2>/dev/null; then
      reuse="$candidate"
      break
    fi
  done < <(find_pythons)
  if [ -z "$py" ]; then
    if [ -n "${FLASHJAX_PYTHON:-}" ]; then
      echo "setup: FLASHJAX_PYTHON=$FLASHJAX_PYTHON is not a Python >= 3.12 (or not found); unset it to search PATH and pyenv" >&2
    else
      echo "setup: flashjax needs Python >= 3.12; none found on PATH or in pyenv" >&2
    fi
    exit 1
  fi
  [ -z "$reuse" ] || py="$reuse"
  "$py" -m venv "$venv" || { rm -rf "$venv"; exit 1; }
  site_dir="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
  if [ -n "$reuse" ]; then
    { echo "# packages of $reuse"; "$reuse" -c "$BASE_SITE_PTH"; } > "$site_dir/flashjax-reuse-base.pth"
  fi
  from="(new, $py)"
  [ -z "$reuse" ] || from="(new)"
else
  site_dir="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
  from="(exists)"
fi

label="flashjax${extras:+[$extras]}"
[ "$gpu" = 1 ] && label="$label (gpu: nvidia-smi -L lists a GPU)"
if [ -f "$site_dir/flashjax-reuse-base.pth" ]; then
  echo "setup: $venv $from reuses the JAX/Flax installed for $(sed -n 's/^# packages of //p' "$site_dir/flashjax-reuse-base.pth") (the pinned versions; nothing downloaded): $label, installed without dependencies"
  if "$venv/bin/python" -c 'import importlib.metadata as md, sys; sys.exit(int(md.version("setuptools").split(".")[0]) < 77)' 2>/dev/null; then
    venv_pip install -q --no-deps --no-build-isolation -e .
  else
    # pyproject needs setuptools >= 77 to build and none can be downloaded: the checkout goes
    # on sys.path directly, and the `flashjax` command is a small script.
    echo "setup: no setuptools >= 77 to build with; the checkout is put on sys.path by a .pth file instead"
    pwd > "$site_dir/flashjax-checkout.pth"
    printf '#!%s\nimport sys\nfrom flashjax.cli import main\nsys.exit(main())\n' "$(pwd)/$venv/bin/python" > "$venv/bin/flashjax"
    chmod +x "$venv/bin/flashjax"
  fi
  # What pyproject asks for (with the extras) and this environment lacks is installed where pip
  # reaches an index (one quick try: a machine without a network fails at once), else listed;
  # the tests that need a missing package then skip themselves.
  missing_file="$(mktemp)"
  "$venv/bin/python" - "$extras" "$missing_file" <<'EOF'
import importlib.metadata as md, sys, tomllib
from pip._vendor.packaging.requirements import Requirement
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
wanted, todo, seen = list(project["dependencies"]), [e for e in sys.argv[1].split(",") if e], set()
while todo:
    extra = todo.pop()
    seen.add(extra)
    for r in map(Requirement, project["optional-dependencies"].get(extra, [])):
        if r.name == "flashjax":
            todo += sorted(r.extras - seen)
        else:
            wanted.append(str(r))
missing = {}
for r in map(Requirement, wanted):
    try:
        version = md.version(r.name)
    except md.PackageNotFoundError:
        missing[r.name] = str(r)
        continue
    if not r.specifier.contains(version, prereleases=True):
        missing[r.name] = str(r)
with open(sys.argv[2], "w") as out:
    out.writelines(f"{requirement}\n" for requirement in sorted(missing.values()))
EOF
  if [ -s "$missing_file" ]; then
    mapfile -t missing < "$missing_file"
    echo "setup: installing what the extras need and this Python lacks: ${missing[*]}"
    if ! venv_pip install -q --retries 0 --timeout 10 -c constraints.txt "${missing[@]}"; then
      echo "setup: could not install them (no network?); tests that need them skip themselves" \
        "(with a network: $venv/bin/python -m pip install -c constraints.txt ${missing[*]})"
    fi
  fi
  rm -f "$missing_file"
elif [ "$latest" = 1 ]; then
  echo "setup: $venv $from: pip installs $label with the newest JAX/Flax inside pyproject's ranges"
  venv_pip install -q --upgrade pip
  venv_pip install -q --upgrade --upgrade-strategy eager -e "$spec"
else
  echo "setup: $venv $from: pip installs $label with the JAX/Flax pinned in constraints.txt"
  venv_pip install -q --upgrade pip
  venv_pip install -q -c constraints.txt -e "$spec"
fi

"$venv/bin/python" - "$gpu" <<'EOF'
import sys
import flax, jax, flashjax
backend = jax.default_backend()
if sys.argv[1] == "1" and backend != "gpu":
    print("setup: warning: nvidia-smi lists a GPU but JAX runs on the CPU (its CUDA plugin did not load; see above)", file=sys.stderr)
print("flashjax", flashjax.__version__, "| jax", jax.__version__, "| flax", flax.__version__, "|", backend)
EOF
