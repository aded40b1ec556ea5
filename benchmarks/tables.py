"""Output shared by the benchmark scripts (no side effects on import: ``run.py`` pins
OPENBLAS_NUM_THREADS when imported, so scripts that time a default environment import
this instead)."""
import time


def emit_table(lines, markdown_path=None):
  """Prints a Markdown table (a list of lines) and also writes it to ``markdown_path``."""
  text = "\n".join(lines)
  print(text)
  if markdown_path:
    with open(markdown_path, "w") as f:
      f.write(text + "\n")


class StreamedTable:
  """A Markdown table printed row by row as each row is measured (progress on long
  runs); ``save()`` writes it, after the date, to ``markdown_path`` (if given)."""

  def __init__(self, header_lines, markdown_path=None):
    self.lines = list(header_lines)
    self.markdown_path = markdown_path
    print("\n".join(self.lines), flush=True)

  def add(self, line):
    self.lines.append(line)
    print(line, flush=True)

  def save(self):
    if self.markdown_path:
      with open(self.markdown_path, "w") as f:
        f.write(f"Date: {time.strftime('%Y-%m-%dT%H:%M:%S')}\n\n" + "\n".join(self.lines)
                + "\n")
