"""``apply`` and ``delete``: edit the manifests folder the way a person would.

Documents are spliced by their text position, so comments and formatting in
the rest of a file survive: every other document stays byte for byte as it was
(tests/test_manifest.py checks it over generated files). Every write is atomic
(a hidden temporary file, then a rename), so the watcher never sees half a file,
and writes are serialized (one lock for the folder's writers in this process):
``apply`` and ``delete`` read the file they change under it, so two of them on
one file never lose each other's change.
"""

from __future__ import annotations

import os
import re
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import yaml

from ..manifest import ManifestError, Rules, check_unique, load_paths, parse_text


@dataclass
class Applied:
    name: str
    file: str
    action: str  # created | configured | unchanged


class ApplyError(ValueError):
    def __init__(self, errors: list[ManifestError]):
        super().__init__("; ".join(map(str, errors)))
        self.errors = errors


def _doc_spans(text: str) -> list[tuple[int, int]]:
    """(start, end) offsets of each non-empty YAML document, with the comments above it."""
    spans, prev_end = [], 0
    for node in yaml.compose_all(text):
        if node is None:
            continue
        start = node.start_mark.index
        head = text[prev_end:start]
        sep = head.rfind("\n---")
        if sep != -1 or head.startswith("---"):
            line_end = head.find("\n", sep + 1)
            start_of_head = prev_end + (line_end + 1 if line_end != -1 else len(head))
        else:
            start_of_head = prev_end
        spans.append((start_of_head, node.end_mark.index))
        prev_end = node.end_mark.index
    return spans


def atomic_write(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically; a symlink's target is written (the link
    stays), and an existing file keeps its mode."""
    if path.is_symlink():
        path = path.resolve()
    try:
        mode = path.stat().st_mode & 0o7777
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


#: Writers of the manifests folder take turns: ``apply`` and ``delete`` run on the
#: default thread pool, and each reads, splices and rewrites whole files.
_WRITING = threading.Lock()


def apply_text(folder: Path, text: str, source_name: str = "<apply>",
               rules: Rules = Rules()) -> list[Applied]:
    """Validate ``text`` (one or more Model documents) as the folder reader would, and
    write it into ``folder``."""
    with _WRITING:
        return _apply_text(folder, text, source_name, rules)


def _apply_text(folder: Path, text: str, source_name: str, rules: Rules) -> list[Applied]:
    new = parse_text(text, source_name, rules)
    if new.errors:
        raise ApplyError(new.errors)
    if new.nodes:
        raise ApplyError([ManifestError(source_name, "Node manifests are not applied: write "
                                        "them as files in the manifests folder of every node")])
    if not new.models:
        raise ApplyError([ManifestError(source_name, "no Model documents found")])
    new_spans = _doc_spans(text)
    current = load_paths([folder], rules=rules)
    where = {lm.manifest.name: lm for r in current for lm in r.models}
    # The folder as it would be: other files' models plus the applied ones must be unique.
    names = {lm.manifest.name for lm in new.models}
    others = [type(r)(r.file, [lm for lm in r.models if lm.manifest.name not in names])
              for r in current if not r.errors]
    check_unique(others + [new])
    if new.errors:
        raise ApplyError(new.errors)
    out: list[Applied] = []
    for lm, (s, e) in zip(new.models, new_spans):
        doc_text = text[s:e].strip("\n") + "\n"
        old = where.get(lm.manifest.name)
        if old is None:
            path = _free_path(folder, lm.manifest.name)
            atomic_write(path, doc_text)
            out.append(Applied(lm.manifest.name, str(path), "created"))
            continue
        if old.manifest == lm.manifest:
            out.append(Applied(lm.manifest.name, old.file, "unchanged"))
            continue
        # Replace only the document itself: the file's own comments stay where they are.
        _replace_doc(Path(old.file), old.document, _without_head_comments(doc_text))
        out.append(Applied(lm.manifest.name, old.file, "configured"))
    return out


def _free_path(folder: Path, name: str) -> Path:
    """``NAME.yaml``, or ``NAME-2.yaml``... when that file exists (it may hold other models,
    or be broken): a new model never overwrites a file."""
    path, n = folder / f"{name}.yaml", 1
    while path.exists() or path.is_symlink():
        n += 1
        path = folder / f"{name}-{n}.yaml"
    return path


def _without_head_comments(doc_text: str) -> str:
    lines = doc_text.splitlines(keepends=True)
    while lines and (not lines[0].strip() or lines[0].lstrip().startswith("#")):
        lines.pop(0)
    return "".join(lines)


def _content_end(node: yaml.Node) -> int:
    """Where a document's own text ends: its last value, not the block's end mark (which
    sits at the next token, past trailing comments and the newline before ``---``)."""
    if isinstance(node, yaml.MappingNode) and not node.flow_style and node.value:
        return _content_end(node.value[-1][1])
    if isinstance(node, yaml.SequenceNode) and not node.flow_style and node.value:
        return _content_end(node.value[-1])
    return node.end_mark.index


#: A document separator line (``---``, maybe followed by a comment or a flow value).
_SEPARATOR = re.compile(r"^---(?=[ \t]|$)[^\n]*\n?", re.M)


def _replace_doc(path: Path, document: int, doc_text: str | None) -> None:
    """Replace (or with None, remove) the ``document``-th (1-based) document of a file;
    the text around it (other documents, comments, separators) is kept as it is."""
    text = path.read_text(encoding="utf-8")
    docs = list(yaml.compose_all(text))
    # Document numbers count empty documents too (see parse_text); map to spans that end
    # where the document's content does (its trailing newline and comments stay).
    spans = []
    for n in docs:
        if n is None:
            spans.append(None)
            continue
        s = n.start_mark.index
        spans.append((s, s + len(text[s:_content_end(n)].rstrip())))
    span = spans[document - 1]
    remaining = [sp for i, sp in enumerate(spans) if sp is not None and i != document - 1]
    if doc_text is None and not remaining:
        path.unlink()
        return
    s, e = span
    if doc_text is None:
        # Drop the document from the separator line that introduced it (with the comments
        # above it) to the end of its last line; a first document has no separator.
        seps = list(_SEPARATOR.finditer(text, 0, s))
        if seps:
            s = seps[-1].start()
        eol = text.find("\n", e)
        new_text = text[:s] + (text[eol + 1:] if eol != -1 else "")
    else:
        new_text = text[:s] + doc_text.rstrip("\n") + text[e:]
    atomic_write(path, new_text if new_text.endswith("\n") else new_text + "\n")


def delete_model(folder: Path, name: str) -> str | None:
    """Remove model ``name`` from the folder; returns the file it was in, if found."""
    with _WRITING:
        return _delete_model(folder, name)


def _delete_model(folder: Path, name: str) -> str | None:
    for r in load_paths([folder]):
        for lm in r.models:
            if lm.manifest.name == name:
                _replace_doc(Path(lm.file), lm.document, None)
                return lm.file
    return None
