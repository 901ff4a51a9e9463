"""Texts of 300-600 tokens and the tasks asked about them: the input-grounded workload of bench.speculative
(quote it, summarise it, edit it), where the answer's next tokens are often in the prompt already."""

from __future__ import annotations

PASSAGES: tuple[str, ...] = (
    "The river town of Alder Ford grew up around a stone bridge built in the early years of the wool trade. "
    "Farmers from the valley brought their fleeces to the market square every Thursday, and merchants from the "
    "coast came up the river road to buy them. The bridge had seven arches, and the town council repaired one "
    "arch every summer, so that the whole bridge was rebuilt every seven years without ever being closed. "
    "When the railway reached the valley, the market moved to a new hall beside the station, and the old square "
    "became a garden with a fountain and a row of lime trees. The mill on the north bank was turned into a "
    "school, and the school into a library when a larger school was built on the hill. Today the town has about "
    "four thousand people. Most of them work in the hospital, in the schools, or in the small workshops that "
    "make furniture from the oak and ash of the nearby forest. Every autumn the town holds a fair on the old "
    "market square, with music, dancing and a contest for the best loaf of bread. Visitors come from the city "
    "by train, walk across the bridge, and climb the hill to see the view of the valley, the river and the "
    "mountains beyond it. The council has a plan to open a museum of the wool trade in the old customs house, "
    "which stands at the south end of the bridge, and to restore the towpath along the river so that people can "
    "walk from Alder Ford to the next village without using the road.",
    "To set up the development server, first install Python 3.11 or newer and create a virtual environment in "
    "the project folder. Activate the environment and install the dependencies with the command pip install -e "
    "followed by a dot and the name of the test extras in square brackets. Copy the file config.example.toml to "
    "config.toml and set the database address, the port and the secret key. The database must be running before "
    "the server starts: on a laptop the simplest way is to start it with the container file in the tools folder. "
    "Run the migrations with the command manage migrate, then create a first user with manage create-user and "
    "the flag that makes that user an administrator. Start the server with manage serve and open the address it "
    "prints in a browser. The server reloads itself when a Python file changes, but not when the configuration "
    "changes: stop it and start it again after editing config.toml. The tests run with pytest from the project "
    "folder; the slow tests are marked and skipped unless the flag that runs them is given. Before sending a "
    "change for review, run the formatter and the linter, make sure every test passes, and write a short note in "
    "the changelog under the heading of the next release. If the server fails to start, check that the port is "
    "free, that the database answers on its address, and that the secret key is set: the log names the first of "
    "these that is wrong.",
)

TASKS: tuple[str, ...] = (
    "Repeat the following text exactly, word for word, without any change.",
    "Rewrite the following text with every sentence kept, but in the past tense.",
    "Copy the following text, and after it list its three most important facts.",
    "Summarise the following text, quoting its key sentences.",
)

OPEN_ENDED: tuple[str, ...] = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator works to a ten year old.",
    "Give me five ideas for a weekend trip in the mountains, with a sentence about each.",
    "What are the pros and cons of working from home? Answer in a few paragraphs.",
    "Describe a day in the life of a medieval blacksmith.",
    "Write a poem about the sea in winter.",
    "How should a beginner start learning to play the guitar?",
    "Invent a new board game and explain its rules.",
)


def grounded_messages(i: int) -> list[dict[str, str]]:
    """The i-th input-grounded chat: a task about one passage (cycling through tasks and passages)."""
    task = TASKS[i % len(TASKS)]
    passage = PASSAGES[(i // len(TASKS)) % len(PASSAGES)]
    return [{"role": "user", "content": f"{task}\n\n{passage}"}]


def open_messages(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": OPEN_ENDED[i % len(OPEN_ENDED)]}]
