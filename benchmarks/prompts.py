"""Benchmark prompts of several kinds: copying-heavy (summary, code edit) and not."""

PROMPTS = {
    "chat": "Give me three tips for staying focused while working from home.",
    "code_new": "Write a Python function that checks whether a string is a palindrome, with a docstring.",
    "code_edit": (
        "Add type hints to this function and keep everything else the same:\n```python\n"
        "def merge_counts(first, second):\n    result = dict(first)\n    for key, value in second.items():\n"
        "        result[key] = result.get(key, 0) + value\n    return result\n```"
    ),
    "summary": (
        "Summarize the following text.\n\nThe city council met on Monday evening to discuss the "
        "proposed riverside park. After two hours of debate, the council approved a budget of "
        "two million dollars for the park. Construction will begin in the spring and is expected "
        "to take eighteen months. The park will include a playground, a walking trail along the "
        "river, and a small amphitheater for summer concerts. Residents who spoke at the meeting "
        "were mostly in favor, although some raised concerns about parking and traffic."
    ),
    "explain": "Explain why the sky is blue.",
}
