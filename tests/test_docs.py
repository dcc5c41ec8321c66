"""The documentation: the site builds strictly, README is a front page, no page cites what
the repository does not hold."""

import os
import pathlib
import re
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
_ENV = dict(os.environ, NO_MKDOCS_2_WARNING="1")


def _build(root, site):
  return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d",
                         str(site)], cwd=root, capture_output=True, text=True, env=_ENV,
                        timeout=300)


def test_the_documentation_site_builds_strictly(tmp_path):
  done = _build(ROOT, tmp_path / "site")
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  assert (tmp_path / "site" / "which-method" / "index.html").exists()
  api = (tmp_path / "site" / "api" / "index.html").read_text()
  assert "micro_batches" in api and "SpecTrain" in api   # from the docstrings


def test_a_broken_link_fails_the_strict_build(tmp_path):
  for name in ("docs", "tfpipe", "bench"):
    (tmp_path / name).symlink_to(ROOT / name)
  shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
  text = (tmp_path / "mkdocs.yml").read_text().replace("docs_dir: docs", "docs_dir: pages")
  (tmp_path / "mkdocs.yml").write_text(text)
  shutil.copytree(ROOT / "docs", tmp_path / "pages")
  page = tmp_path / "pages" / "index.md"
  page.write_text(page.read_text() + "\nSee [the missing page](missing.md).\n")
  done = _build(tmp_path, tmp_path / "site")
  assert done.returncode != 0 and "missing.md" in done.stdout + done.stderr


def test_every_page_is_in_the_navigation_and_every_entry_exists():
  config = (ROOT / "mkdocs.yml").read_text()
  listed = set(re.findall(r":\s+([\w-]+\.md)\s*$", config, re.M))
  pages = {p.name for p in (ROOT / "docs").glob("*.md")}
  assert listed == pages


def test_readme_is_a_front_page():
  readme = (ROOT / "README.md").read_text()
  assert len(readme.splitlines()) <= 250
  for section in ("## Quickstart", "## From Python", "## Which method?", "## Documentation"):
    assert section in readme


def test_no_page_or_module_cites_a_document_outside_the_repository():
  cited = []
  paths = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "tfpipe").rglob("*.py"),
           *(ROOT / "trainers").glob("*.py"), *(ROOT / "configs").glob("*.cfg")]
  for path in paths:
    text = path.read_text().lower()
    for term in ("../shared", "design.md", "seed 00", "epfl"):
      if term in text:
        cited.append(f"{path.relative_to(ROOT)}: {term}")
  assert cited == []
