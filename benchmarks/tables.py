"""Output shared by the benchmark scripts (no side effects on import: ``run.py`` pins
OPENBLAS_NUM_THREADS when imported, so scripts that time a default environment import
this instead)."""


def emit_table(lines, markdown_path=None):
  """Prints a Markdown table (a list of lines) and also writes it to ``markdown_path``."""
  text = "\n".join(lines)
  print(text)
  if markdown_path:
    with open(markdown_path, "w") as f:
      f.write(text + "\n")
