"""No function of the kernel templates runs over MAX_LINES lines, from its signature to its closing brace.

A long attend body holds several modes in one scope, where a reader has to keep every local in
mind; named __forceinline__ steps compile to the same code. The scan below is a brace matcher that
skips comments, string and character literals, preprocessor lines and (in .j2 files) Jinja tags:
enough for the templates' C++, which nests lambdas and control blocks inside functions (they count
toward the function holding them) and functions inside namespaces, structs and extern blocks.
"""

from __future__ import annotations

import re

import pytest

from flashjit.jit.render import template_root

MAX_LINES = 150
SUFFIXES = (".cuh", ".cuh.j2", ".cu.j2")
JINJA_TAG = re.compile(r"\{#.*?#\}|\{%.*?%\}|\{\{.*?\}\}", re.S)
# A literal or comment (skipped), or a brace or statement end (kept), in the order they come.
TOKEN = re.compile(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'|[{};]', re.S)
CONTROL = {"if", "for", "while", "switch", "catch", "do", "else", "try", "return"}
SCOPE = re.compile(r"(template\s*<[^>]*>\s*)?(namespace|struct|class|union|enum)\b")


def _blank(match: re.Match) -> str:
    """The matched text with everything but its newlines made spaces: line numbers stay put."""
    return re.sub(r"[^\n]", " ", match.group(0))


def _code(text: str, jinja: bool) -> str:
    """The text with Jinja tags (if jinja), preprocessor lines (continuations included), comments and
    literals blanked: what is left of it is C++ whose braces all count."""
    if jinja:
        text = JINJA_TAG.sub(_blank, text)
    lines, continued = [], False
    for line in text.split("\n"):
        directive = continued or line.lstrip().startswith("#")
        continued = directive and line.rstrip().endswith("\\")
        lines.append(" " * len(line) if directive else line)
    return TOKEN.sub(lambda m: m.group(0) if m.group(0) in "{};" else _blank(m), "\n".join(lines))


def _opens_function(header: str) -> bool:
    """Whether the code between the previous statement end and a '{' outside any function is a
    function's signature: a parameter list and its qualifiers, not a scope, a control statement or
    an initializer (a lambda outside a function is one)."""
    words = re.findall(r"[A-Za-z_]\w*", header)
    if not words or words[0] in CONTROL or SCOPE.match(header.strip()) or re.match(r"[^(]*=", header):
        return False
    return bool(re.search(r"\)\s*(const|noexcept|override|final|\s)*$", header))


def functions(text: str, jinja: bool = False) -> list[tuple[str, int, int]]:
    """(signature, first line, last line) of every function outside another function, lines from 1;
    a function's first line is its declaration's (a template line included)."""
    code = _code(text, jinja)
    found, stack, header_start = [], [], 0  # stack: (a function or inside one, a function's start offset)
    for match in re.finditer(r"[{};]", code):
        token = match.group(0)
        if token == "{":
            inside = bool(stack) and stack[-1][0]
            header = code[header_start: match.start()]
            opens = not inside and _opens_function(header)
            start = header_start + len(header) - len(header.lstrip())
            stack.append((inside or opens, start if opens else -1))
        elif token == "}":
            if not stack:
                raise ValueError(f"unbalanced '}}' at line {code.count(chr(10), 0, match.start()) + 1}")
            _, start = stack.pop()
            if start >= 0:
                signature = " ".join(code[start: code.index("{", start)].split())
                found.append((signature, code.count("\n", 0, start) + 1, code.count("\n", 0, match.start()) + 1))
        header_start = match.end()
    if stack:
        raise ValueError("unbalanced '{': a brace never closes")
    return found


TEMPLATES = sorted(p for p in template_root().rglob("*") if p.is_file() and p.name.endswith(SUFFIXES))


@pytest.mark.parametrize("path", TEMPLATES, ids=lambda p: str(p.relative_to(template_root())))
def test_no_template_function_runs_over_the_limit(path):
    long = [(signature[:80], last - first + 1)
            for signature, first, last in functions(path.read_text(), jinja=path.suffix == ".j2")
            if last - first + 1 > MAX_LINES]
    assert not long, f"{path.name}: functions over {MAX_LINES} lines: {long}"


def test_the_scan_finds_the_attend_bodies():
    """The scan sees the functions it is meant to bound (a parser that found none would pass)."""
    root = template_root()
    names = {re.search(r"(\w+)\s*\(", signature).group(1)
             for path in ("decode/tc.cuh", "decode/cuda_core.cuh", "mla/mma.cuh", "mla/wgmma.cuh")
             for signature, _, _ in functions((root / path).read_text())}
    assert {"attend", "attend_packed", "attend_wgmma", "store_row"} <= names


def _function(lines: int, body_line: str) -> str:
    return "FJ_INLINE void f(int a,\n                 int b) {\n" + body_line * (lines - 3) + "}\n"


@pytest.mark.parametrize("lines", [MAX_LINES, MAX_LINES + 1])
def test_a_function_is_counted_from_its_signature_to_its_closing_brace(lines):
    text = "namespace n {\n// a comment {\nstruct S {\n" + _function(lines, "  x += 1;\n") + "};\n}\n"
    ((signature, first, last),) = functions(text)
    assert signature.startswith("FJ_INLINE void f(int a, int b)") and (first, last - first + 1) == (4, lines)


def test_braces_in_comments_strings_directives_lambdas_and_jinja_do_not_count():
    text = ("template <int N>\n"                                         # 1
            "FJ_INLINE void f(int stride = N) {\n"                       # 2
            "  const auto g = [&](int k) -> int { return k; };  // }}\n"  # 3
            '  asm volatile("{ mov.u32 %0, 1; }" : "=r"(x));\n'          # 4
            "  /* { */ if (x) { y = '}'; }\n"                            # 5
            "#define M(x) do { \\\n"                                    # 6
            "  x; } while (0)\n"                                         # 7
            "  {% if flag %}y{% endif %} {{ name }}\n"                   # 8
            "}\n"                                                        # 9
            "constexpr int PARTS[] = {1, 2};\n"                          # 10: an initializer
            "struct S { int a; FJ_INLINE S(int b) : a(b) {} };\n"        # 11
            'extern "C" __global__ void k(Args a) {\n'                   # 12
            "  f(a);\n"
            "}\n")
    found = functions(text, jinja=True)
    assert [(s.split("(")[0], first, last) for s, first, last in found] == [
        ("template <int N> FJ_INLINE void f", 1, 9), ("FJ_INLINE S", 11, 11), ("extern __global__ void k", 12, 14)]


def test_a_brace_that_never_closes_is_an_error():
    with pytest.raises(ValueError, match="never closes"):
        functions("void f() {\n  if (x) {\n}\n")
