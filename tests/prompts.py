"""Varied prompts shared by the engine and server tests (short, long, chat and plain)."""

LONG_TEXT = (
    "The history of computing is a story of ideas that outgrew the machines they were born on. "
    "Early mechanical calculators could add and subtract; later, relay and vacuum-tube machines "
    "ran programs stored on punched tape, and the stored-program computer made software a thing "
    "of its own. Transistors shrank the machines, integrated circuits shrank them further, and "
    "the microprocessor put a whole computer on one chip. Networks then tied the chips together, "
    "and the web turned the network into a place where people meet, trade and learn. "
) * 6

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors.",
    "Explain what a CPU does in one sentence.",
    "Translate 'good morning' into Spanish.",
    "Give me a short tip for learning to cook.",
    "Summarize this text in one sentence: " + LONG_TEXT,
    "What is 12 times 12?",
]

PLAIN_PROMPTS = [
    "Once upon a time, in a small village by the river,",
    "The three laws of thermodynamics are",
    "def fibonacci(n):\n    ",
    "Paris is a city in",
    LONG_TEXT + "In short,",
    "Q: What color is the sky on a clear day?\nA:",
    "import numpy as np\n\n# Compute the mean of a list\n",
    "Hello",
]
