"""Benchmark prompts of several kinds: copying-heavy (summary, code edit) and not; and the
load scenario's ten kinds (`LOAD_PROMPTS`)."""

from collections.abc import Sequence

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

# More prompts of each kind, for replays that must tell a policy's rule from one path's luck
# (benchmarks/replay_policy.py --prompt-set more): a fixed k best in hindsight on one 64-token
# path is partly where that path's rejections fall.
MORE_PROMPTS = {
    "chat": (
        "What are some good ways to make new friends after moving to a new city?",
        "How can I get better sleep when I have a busy schedule?",
        "Suggest a simple weekly plan for someone who wants to start running.",
        "What should I pack for a three-day hiking trip?",
        "Give me some ideas for a birthday present for my grandmother.",
        "How do I prepare for a job interview at a small company?",
    ),
    "code_new": (
        "Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring.",
        "Write a Python function that counts how often each word appears in a text, with a docstring.",
        "Write a Python class for a stack with push, pop and peek methods.",
        "Write a Python function that merges two sorted lists into one sorted list.",
        "Write a JavaScript function that removes duplicate values from an array.",
        "Write a Python function that checks whether a number is prime, with a docstring.",
    ),
    "code_edit": (
        "Rename the variable `total` to `running_sum` in this function and change nothing else:\n```python\n"
        "def add_all(numbers):\n    total = 0\n    for number in numbers:\n        total += number\n"
        "    return total\n```",
        "Add a docstring to this function and keep the code the same:\n```python\n"
        "def clamp(value, low, high):\n    if value < low:\n        return low\n    if value > high:\n"
        "        return high\n    return value\n```",
        "Make this function skip empty lines and keep everything else the same:\n```python\n"
        "def read_names(path):\n    names = []\n    with open(path) as handle:\n        for line in handle:\n"
        "            names.append(line.strip())\n    return names\n```",
        "Add type hints to this class and keep everything else the same:\n```python\n"
        "class Counter:\n    def __init__(self, start):\n        self.value = start\n\n    def increment(self, step):\n"
        "        self.value += step\n        return self.value\n```",
        "Change this function to use a list comprehension and keep its behaviour:\n```python\n"
        "def squares_of_evens(values):\n    result = []\n    for value in values:\n        if value % 2 == 0:\n"
        "            result.append(value * value)\n    return result\n```",
        "Add error handling for a missing key to this function and keep everything else the same:\n```python\n"
        'def get_port(config):\n    server = config["server"]\n    port = server["port"]\n'
        "    return int(port)\n```",
    ),
    "summary": (
        "Summarize the following text.\n\nThe library will extend its opening hours starting next month. On "
        "weekdays it will stay open until nine in the evening, and on Saturdays until six. The change follows a "
        "survey in which most visitors asked for later hours, especially students preparing for exams. To pay "
        "for the extra staff, the library will reduce its spending on new magazines. The children's reading "
        "room will keep its current hours.",
        "Summarize the following text.\n\nA local bakery has won a regional award for its sourdough bread. The "
        "owners, a married couple who opened the shop five years ago, bake every loaf by hand and let the dough "
        "rise overnight. They plan to use the prize money to buy a second oven so that they can sell bread to "
        "nearby restaurants. Customers often queue outside before the shop opens at seven in the morning.",
        "Summarize the following text.\n\nThe school district announced that all high schools will start thirty "
        "minutes later next year. Research suggests that teenagers sleep better and learn more when classes "
        "begin later in the morning. Bus schedules will change, and sports practices will end later in the "
        "afternoon. Some parents worry about childcare, while teachers mostly support the plan.",
        "Summarize the following text.\n\nHeavy rain caused the river to flood several streets in the old town "
        "on Tuesday night. Firefighters helped residents move to higher ground, and no one was hurt. The water "
        "damaged a number of shops and the basement of the town museum, where some paintings were stored. The "
        "mayor said the town would ask the regional government for help to repair the damage.",
        "Summarize the following text.\n\nA new bicycle sharing program launched in the city this week with "
        "five hundred bikes at fifty stations. Riders pay a small fee for each trip or buy a monthly pass. The "
        "city hopes the program will reduce traffic and pollution in the center. In its first three days, more "
        "than four thousand trips were made, most of them during the morning and evening rush hours.",
        "Summarize the following text.\n\nThe museum opened an exhibition about the history of clocks and "
        "timekeeping. Visitors can see sundials, water clocks, early mechanical clocks and modern atomic "
        "clocks. One room lets children take apart and rebuild a simple clock. The exhibition runs until the "
        "end of the year, and entry is free on the first Sunday of every month.",
    ),
    "explain": (
        "Explain how a refrigerator keeps food cold.",
        "Explain why leaves change color in the autumn.",
        "Explain how vaccines help the body fight disease.",
        "Explain what causes the seasons on Earth.",
        "Explain how a compiler differs from an interpreter.",
        "Explain why bread rises when it is baked.",
    ),
}


PROMPT_SETS = ("", "more", "all")


def prompt_texts(kinds: Sequence[str], prompt_set: str = "") -> dict[str, str]:
    """{name: text}: PROMPTS' prompt of each kind; "more": MORE_PROMPTS' (named kind/1..6);
    "all": both (PROMPTS' named kind/0)."""
    if prompt_set == "all":
        return {f"{kind}/0": PROMPTS[kind] for kind in kinds} | prompt_texts(kinds, "more")
    if prompt_set == "more":
        return {
            f"{kind}/{i}": text
            for kind in kinds
            for i, text in enumerate(MORE_PROMPTS[kind], start=1)
        }
    return {kind: PROMPTS[kind] for kind in kinds}


def kind_of(name: str) -> str:
    """The kind of a prompt named by prompt_texts."""
    return name.split("/")[0]


# The load scenario's ten kinds of request (bench_load, bench_failover), some with text to
# copy (the n-gram drafter's case), some without.
LOAD_PROMPTS = {
    "chat": "I just moved to a new city and don't know anyone. How can I make friends as an adult?",
    "code_new": "Write a Python function that returns the n-th Fibonacci number iteratively, with a short docstring.",
    "code_fix": (
        "This function should return the largest value in a list but it crashes on some inputs. Fix it:\n"
        "```python\ndef largest(values):\n    best = values[0]\n    for value in values:\n"
        "        if value > best:\n            best = value\n    return best\n```"
    ),
    "summary": (
        "Summarise this paragraph in two sentences.\n\nThe library on Elm Street will close for renovation "
        "from March to August. During the closure, books can be borrowed from the mobile library, which will "
        "visit the town square every Tuesday and Friday. The renovation adds a children's reading room, new "
        "study desks with power outlets, and a lift to the first floor. Members keep their cards, and all "
        "due dates during the closure are extended until September."
    ),
    "explain": "Explain how a refrigerator keeps food cold, in plain words for a ten-year-old.",
    "list": "List seven vegetables that grow well in a small balcony garden, one per line.",
    "rewrite": (
        "Rewrite this message so that it sounds polite and professional:\n\n"
        "hey, the report you sent is late again and half the numbers are wrong. fix it by friday."
    ),
    "extract": (
        "From the text below, give the name, the date and the city, as 'name: ..., date: ..., city: ...'.\n\n"
        "Dear Ms. Laura Bennett, we are happy to confirm your booking for the design workshop on 14 June "
        "2025 in Lisbon. Please arrive fifteen minutes early to collect your badge."
    ),
    "sql": "Write an SQL query that returns the ten customers with the highest total order value from tables "
    "customers(id, name) and orders(id, customer_id, amount).",
    "email": "Draft a short email to a colleague asking to move our Thursday meeting to next Monday morning.",
}
