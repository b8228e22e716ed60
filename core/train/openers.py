"""Opening words that steer self-written prompts toward task kinds a chat benchmark asks for.

Plain Magpie sampling (``self_prompts``) gives the prompts a small model finds most likely:
short questions. Chat benchmarks such as MT-bench also ask for long-form writing, role-play,
puzzles, word problems, code, extraction from a given text, and STEM and humanities essays,
and a head trained only on answers to short questions drafts those answers worse (per-category
chain acceptance, measured at b73a4f3). Appending an opening such as
"Imagine you are" to the user turn's prefix makes the target write the rest of such a prompt
itself, so the prompt and its answer both stay the target's own text.

The list is ours (no benchmark question is used); the empty opener keeps plain Magpie draws
in the mix so that the head does not forget the short-question style.
"""

from __future__ import annotations

from pathlib import Path

from polyspec.errors import ConfigError

BUILTIN_OPENERS: tuple[str, ...] = (
    "",
    # long-form writing
    "Write a blog post",
    "Compose an email",
    "Draft a letter",
    "Write a short story",
    "Write a poem",
    "Write a persuasive essay",
    "Write a speech",
    "Write a product description",
    "Create a",
    "",
    # role-play
    "Imagine you are",
    "Pretend you are",
    "Act as",
    "You are a",
    "Suppose you are",
    "Play the role of",
    # reasoning and puzzles
    "If",
    "Suppose",
    "There are",
    "Which of the following",
    "Explain why",
    "",
    # math
    "Solve",
    "Calculate",
    "Find the",
    "What is the probability",
    "How many",
    "Prove that",
    # code
    "Write a Python function",
    "Write a program",
    "Implement",
    "Write a JavaScript function",
    "Write a SQL query",
    "Write a C++ program",
    "Fix the bug in",
    "",
    # extraction and rewriting of a given text
    "Extract",
    "Given the following text",
    "Read the following passage",
    "Summarize the following",
    "Identify the",
    "Rewrite the following",
    # STEM
    "Explain how",
    "Describe the process",
    "What are the differences between",
    "How does",
    "What is the role of",
    "",
    # humanities
    "Discuss",
    "Analyze",
    "Compare and contrast",
    "What were the causes of",
    "Evaluate the impact of",
    "What is the significance of",
)


def load_openers(spec: str | None) -> tuple[str, ...]:
    """``None`` -> no openers (plain Magpie); ``"builtin"`` -> :data:`BUILTIN_OPENERS`; else a
    text file with one opener per line (an empty line is a plain draw)."""
    if spec is None:
        return ("",)
    if spec == "builtin":
        return BUILTIN_OPENERS
    path = Path(spec)
    if not path.is_file():
        raise ConfigError(
            f"--self-prompt-openers {spec}: not a file; pass 'builtin' or a text file with one "
            "opening per line"
        )
    openers = tuple(line.rstrip("\n").strip() for line in path.read_text().splitlines())
    if not openers:
        raise ConfigError(f"--self-prompt-openers {spec}: the file is empty")
    return openers
