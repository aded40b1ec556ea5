"""Every experiment binary's --help lists every flag it uses, and it accepts no other.

Checked on the absl flag registry (cheap, in-process) for every binary, by reading each
binary's source for the flags it defines, the shared flags it declares with
``common.define_flags`` and the shared flags behind the ``common`` accessors it calls;
one subprocess checks the real ``python -m experiments.benchmark --help`` output and
that a binary rejects a shared flag it does not use.
"""
import ast
import glob
import importlib
import os
import subprocess
import sys

from absl import flags
import pytest

from experiments import common

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BINARIES = sorted(
    os.path.splitext(os.path.basename(p))[0]
    for p in glob.glob(os.path.join(ROOT, "experiments", "*.py"))
    if "app.run(main)" in open(p).read())


def _is_call_to(node, owner, name=None):
  return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
          and isinstance(node.func.value, ast.Name) and node.func.value.id == owner
          and (name is None or node.func.attr == name))


def _source_flags(module_name):
  """(own flags, declared shared flags, shared flags read, own flags read) from source."""
  path = os.path.join(ROOT, *module_name.split(".")) + ".py"
  tree = ast.parse(open(path).read())
  own, declared, read_shared, holders, read_holders = set(), set(), set(), {}, set()
  for node in ast.walk(tree):
    if _is_call_to(node, "flags") and node.func.attr.startswith("DEFINE_"):
      own.add(node.args[0].value)
    if _is_call_to(node, "common", "define_flags"):
      declared |= {a.value for a in node.args}
    if _is_call_to(node, "common") and node.func.attr in common.ACCESSOR_FLAGS:
      read_shared |= set(common.ACCESSOR_FLAGS[node.func.attr])
    if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
        and _is_call_to(node.value, "flags")
        and node.value.func.attr.startswith("DEFINE_")):
      holders[node.targets[0].id] = node.value.args[0].value
    if (isinstance(node, ast.Attribute) and node.attr == "value"
        and isinstance(node.value, ast.Name)):
      read_holders.add(node.value.id)
  own_read = {holders[h] for h in read_holders if h in holders}
  return own, declared, read_shared, own_read


def test_binaries_found():
  assert {"benchmark", "demo", "synthetic", "dim_sweep", "covariance_analysis",
          "embed_clinc150"} <= set(BINARIES)


@pytest.mark.parametrize("binary", BINARIES)
def test_help_lists_every_flag_the_binary_uses(binary):
  name = f"experiments.{binary}"
  module = importlib.import_module(name)
  own, declared, read_shared, own_read = _source_flags(name)
  key = {f.name for f in flags.FLAGS.get_key_flags_for_module(module)}
  # Everything it defines or declares is a key flag (shown by --help), nothing else.
  assert key == own | declared, (binary, key ^ (own | declared))
  # It declares exactly the shared flags it reads (an unused --quick is not accepted).
  assert declared == read_shared, (binary, declared ^ read_shared)
  # Every flag it defines is read.
  assert own == own_read, (binary, own ^ own_read)
  help_text = flags.FLAGS.module_help(module)
  for flag in key:
    assert f"--{flag}" in help_text or f"--[no]{flag}" in help_text, (binary, flag)
  # Naming: binary-specific flags carry a prefix, shared ones live in common.
  for flag in own:
    assert flag not in common.SHARED_FLAGS
    assert flag.startswith((binary.split("_")[0] + "_", "embed_", "highdim_")), flag


def test_accessor_table_matches_what_accessors_read(monkeypatch):
  """common.ACCESSOR_FLAGS (used above) lists exactly the flags each accessor reads."""
  defaults = {"float64": False, "output_dir": None, "seed": 3, "num_seeds": None,
              "plot_only": False, "quick": False, "fpr_positive": "ood",
              "models": ["rmds"], "num_components": None, "train": None, "test": None,
              "near_ood": [], "far_ood": []}
  calls = {"setup_from_flags": ("x",), "seeds": (2,), "num_components_flag": (4,)}
  tree = ast.parse(open(common.__file__).read())
  readers = {f.name for f in tree.body if isinstance(f, ast.FunctionDef)
             and f.name != "_value"
             and any(isinstance(n, ast.Call) and getattr(n.func, "id", None) == "_value"
                     for n in ast.walk(f))}
  assert readers == set(common.ACCESSOR_FLAGS)
  for accessor, expected in common.ACCESSOR_FLAGS.items():
    seen = []
    monkeypatch.setattr(common, "_value",
                        lambda n, seen=seen: seen.append(n) or defaults[n])
    getattr(common, accessor)(*calls.get(accessor, ()))
    assert set(seen) == set(expected), accessor


def test_reading_an_undeclared_flag_is_a_clear_error():
  with pytest.raises(RuntimeError, match="--no_such_flag.*define_flags"):
    common._value("no_such_flag")
  with pytest.raises(ValueError, match="Unknown shared flag"):
    common.define_flags("no_such_flag")


def test_real_help_and_rejected_flags():
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
             JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-m", "experiments.benchmark", "--help"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
  assert "Traceback" not in out.stderr, out.stderr  # absl's --help exits with status 1
  for flag in ("train", "test", "near_ood", "far_ood", "output_dir", "fpr_positive",
               "num_components", "benchmark_title", "seed", "models"):
    assert f"--{flag}" in out.stdout, flag
  # The demo has no --quick (its default is already small): rejected, not ignored.
  out = subprocess.run([sys.executable, "-m", "experiments.demo", "--quick"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
  assert out.returncode != 0 and "Unknown command line flag 'quick'" in out.stderr
