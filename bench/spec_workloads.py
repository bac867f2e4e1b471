"""The texts of bench/speculative.py's workloads, the same requests for every stack (seeded choices):
- edit: "repeat this paragraph exactly, but change the word X to Y" (chat), whose answer quotes the prompt;
- code: completion over a long, regular Python module (raw text), whose continuation follows patterns the
  prompt already has;
- chat: plain questions (chat), with little to look up.
"""

from __future__ import annotations

import random
import time

from common.pb.tpserve.v1 import generation_pb2 as pb

# The subjects of "edit": a paragraph each, and the word to change in it.
PARAGRAPHS = [
    (
        "river",
        "canal",
        "The river ran through the middle of the old town, and every morning the market traders set up "
        "their stalls along its banks. Children threw bread to the ducks that gathered near the bridge, "
        "while fishermen waited patiently for the river to give them their breakfast. In the evening the "
        "river turned gold under the setting sun, and couples walked slowly beside it before going home.",
    ),
    (
        "teacher",
        "coach",
        "Our teacher arrived early every day to prepare the classroom. She wrote the plan for the lesson "
        "on the board, sharpened the pencils and opened the windows. When the students came in, the "
        "teacher greeted each of them by name. Years later, many of them said that the teacher had been "
        "the reason they kept learning long after they had left school.",
    ),
    (
        "train",
        "bus",
        "The train left the station at seven o'clock sharp. Passengers found their seats, put their bags "
        "on the racks and opened their newspapers. As the train gathered speed, the city gave way to "
        "fields and forests. By the time the train reached the coast, most of the passengers had fallen "
        "asleep, and only the conductor was still walking up and down the aisle.",
    ),
    (
        "garden",
        "park",
        "Behind the house there was a small garden full of roses, tulips and tall sunflowers. My "
        "grandmother spent hours in the garden, pulling weeds and watering the plants. She said the "
        "garden taught her patience, because nothing in it could be hurried. When she grew too old to "
        "kneel, we kept the garden for her, and she sat on the bench and told us what to do.",
    ),
    (
        "computer",
        "laptop",
        "The computer on my desk is almost ten years old, but it still works. I use the computer to "
        "write letters, to read the news and to talk with my family far away. Every year someone tells "
        "me to buy a new computer, and every year I say the same thing: as long as it turns on in the "
        "morning, this computer is good enough for me.",
    ),
    (
        "winter",
        "autumn",
        "Winter came early that year. The first snow fell in October, and by November the lake had "
        "frozen solid. The village children skated on the ice every afternoon, and their parents "
        "gathered around fires to drink hot tea. Everyone agreed that it was the coldest winter they "
        "could remember, and yet, strangely, it was also the happiest winter of their lives.",
    ),
    (
        "doctor",
        "nurse",
        "The doctor listened carefully to every patient. She never hurried, even when the waiting room "
        "was full. When a patient was afraid, the doctor explained each step of the examination before "
        "she began. People travelled from other towns to see her, because they knew the doctor would "
        "treat them as people and not only as a list of symptoms.",
    ),
    (
        "ship",
        "boat",
        "The ship sailed out of the harbour on a calm and clear morning. Sailors climbed the masts to "
        "set the sails, and the captain stood at the wheel. For three days the ship crossed open water "
        "without seeing another vessel. On the fourth day a storm arrived, and the ship rocked so hard "
        "that even the oldest sailors held on to the ropes.",
    ),
]

QUESTIONS = [
    "Why is the sky blue? Explain it to a ten year old.",
    "Write a short story about a robot who learns to paint.",
    "What are three good habits for staying healthy?",
    "Describe your ideal weekend in a few sentences.",
    "How do airplanes stay in the air?",
    "Give me some advice for my first day at a new job.",
    "What is the difference between weather and climate?",
    "Write a poem about the sea.",
    "Why do people enjoy music?",
    "Explain how a bicycle works.",
    "What should I cook for dinner tonight, and why?",
    "Tell me about the history of the printing press.",
]

FIELDS = [
    "name",
    "email",
    "city",
    "country",
    "phone",
    "title",
    "company",
    "street",
    "zip_code",
    "birthday",
    "language",
    "timezone",
    "website",
    "nickname",
    "department",
    "manager",
    "salary",
    "start_date",
]


def code_prompt(seed: int) -> str:
    """A regular Python module (a record class with a getter, a setter and a validator per field) that
    stops inside the next field's getter: about 1,500 tokens."""
    rng = random.Random(seed)
    fields = rng.sample(FIELDS, len(FIELDS))
    cls = rng.choice(["Customer", "Employee", "Member", "Supplier", "Student"])
    lines = [f'"""The {cls.lower()} record and its accessors."""', "", "", f"class {cls}:", ""]
    lines.append("    def __init__(self):")
    lines += [f"        self._{f} = None" for f in fields]
    for f in fields[:-3]:
        lines += ["", f"    def get_{f}(self):", f'        """Returns the {cls.lower()}\'s {f}."""']
        lines += [f"        return self._{f}", "", f"    def set_{f}(self, value):"]
        lines += [f'        """Sets the {cls.lower()}\'s {f}, after checking it."""']
        lines += [f"        self.validate_{f}(value)", f"        self._{f} = value", ""]
        lines += [f"    def validate_{f}(self, value):", "        if value is None:"]
        lines += [f'            raise ValueError("{f} must not be None")']
    lines += ["", f"    def get_{fields[-3]}(self):"]
    return "\n".join(lines)


def requests_for(workload: str, n: int, seed: int, max_new: int) -> list[pb.GenerateRequest]:
    greedy = pb.SamplingParams(temperature=0.0)
    out = []
    for i in range(n):
        if workload == "edit":
            old, new, text = PARAGRAPHS[(seed + i) % len(PARAGRAPHS)]
            ask = f"Repeat the following paragraph exactly, but change the word '{old}' to '{new}':\n\n{text}"
            kw = dict(messages=[pb.ChatMessage(role="user", content=ask)])
        elif workload == "code":
            kw = dict(text=code_prompt(seed + i))
        else:
            kw = dict(messages=[pb.ChatMessage(role="user", content=QUESTIONS[(seed + i) % len(QUESTIONS)])])
        out.append(
            pb.GenerateRequest(
                request_id=f"spec-{workload}-{seed}-{i}-{time.time_ns():x}",
                max_new_tokens=max_new,
                sampling=greedy,
                **kw,
            )
        )
    return out
