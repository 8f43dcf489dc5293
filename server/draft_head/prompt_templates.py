"""The shipped training prompt set, built from templates x topics (deterministic; no downloads).

`python -m server.draft_head.prompt_templates > server/draft_head/prompts/train.jsonl` rewrites the
file that ships in the package. Held-out prompts (`prompts/heldout.jsonl`) are written by hand in a
different style and never come from these templates, so held-out acceptance measures generalisation.
"""

from __future__ import annotations

import json
import random
import sys

TOPICS = [
    "photosynthesis", "black holes", "the water cycle", "plate tectonics", "vaccines", "the immune system",
    "climate change", "renewable energy", "electric cars", "the stock market", "inflation", "compound interest",
    "machine learning", "neural networks", "the internet", "encryption", "blockchain", "quantum computing",
    "the French Revolution", "the Roman Empire", "ancient Egypt", "the Renaissance", "the Industrial Revolution",
    "World War I", "the Cold War", "the printing press", "democracy", "the solar system", "the Moon landing",
    "volcanoes", "earthquakes", "hurricanes", "coral reefs", "rainforests", "deserts", "honey bees", "dolphins",
    "dinosaurs", "evolution", "DNA", "the human heart", "sleep", "nutrition", "meditation", "exercise",
    "coffee", "tea", "chocolate", "bread baking", "gardening", "composting", "recycling", "public transport",
    "city planning", "remote work", "time management", "public speaking", "learning a new language",
    "chess", "football", "the Olympic Games", "jazz music", "classical music", "painting", "photography",
    "film making", "poetry", "Shakespeare", "mythology", "philosophy", "ethics", "psychology", "economics",
    "supply and demand", "the scientific method", "statistics", "probability", "algebra", "geometry",
    "prime numbers", "gravity", "electricity", "magnetism", "light", "sound", "atoms", "chemical reactions",
    "batteries", "solar panels", "wind turbines", "3D printing", "robots", "smartphones", "social media",
    "video games", "space exploration", "Mars", "the ocean", "rivers", "mountains", "glaciers", "birds",
    "cats", "dogs", "friendship", "kindness", "leadership", "teamwork", "budgeting", "saving money",
    "cooking pasta", "healthy breakfasts", "travel in Japan", "the history of tea", "the Great Wall of China",
    "the pyramids", "libraries", "museums", "the human brain", "memory", "habits", "creativity",
]

AUDIENCES = ["a child", "a beginner", "a high school student", "a busy professional", "my grandmother"]
ACTIVITIES = [
    "studying for exams", "staying focused", "sleeping better", "starting a small business", "running a marathon",
    "writing an essay", "making new friends", "cooking on a budget", "learning to code", "keeping a plant alive",
    "preparing for a job interview", "reducing stress", "travelling light", "organizing a closet",
    "saving for retirement", "writing a cover letter", "learning to draw", "staying motivated",
]
CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "computes the factorial of n",
    "returns the n-th Fibonacci number", "counts the words in a sentence", "removes duplicates from a list",
    "sorts a list of dictionaries by a key", "reads a CSV file and prints each row", "merges two sorted lists",
    "checks whether a string is a palindrome", "finds the largest element in a list", "converts Celsius to Fahrenheit",
    "flattens a nested list", "counts how often each character appears in a string", "computes the average of a list",
    "validates an email address with a regular expression", "implements binary search", "transposes a matrix",
]
LANGUAGES = ["Python", "JavaScript", "Rust", "Go", "Java", "C", "Bash", "SQL"]
CODE_QUESTIONS = [
    "read a file line by line", "make an HTTP request", "handle errors", "write a unit test", "sort a list",
    "parse JSON", "use a dictionary or map", "write a loop", "define a class", "format a date",
]
SENTENCES = [
    "me and him goes to the store yesterday", "the meeting have been moved to next week",
    "I can't come to the party because I has work", "The results was better then we expected",
    "Please send me the report as soon as possible", "We need to talk about the budget for next year",
    "The cat sat on the mat and looked out the window", "Our team finished the project two days early",
    "I think this idea is really good and we should do it", "The weather today is cold and rainy",
]
PARAGRAPHS = [
    "The city council met on Tuesday to discuss the new park. Residents asked for more trees, a playground "
    "and better lighting. The council agreed to fund the playground this year and the lighting next year.",
    "Bees pollinate many of the crops we eat. In recent years bee populations have declined because of "
    "pesticides, disease and loss of habitat. Farmers and gardeners can help by planting flowers.",
    "The company reported higher sales in the third quarter, driven by strong demand for its new laptop. "
    "However, costs also rose, so profits were flat compared to last year.",
    "Learning to play an instrument takes patience. Short daily practice sessions are more effective than "
    "long weekly ones, and recording yourself helps you hear what to improve.",
]
CHARACTERS = ["a lonely robot", "a young wizard", "a curious cat", "an old fisherman", "a brave girl", "a lost dog"]
EVENTS = ["finds a hidden door", "learns to fly", "makes an unexpected friend", "gets lost in a city", "wins a prize"]
RECIPIENTS = ["my manager", "a customer", "my landlord", "a teacher", "a colleague"]
SUBJECTS = ["a late delivery", "a day off", "a broken heater", "a project update", "a meeting next week"]
MOODS = ["tired", "stressed", "bored", "anxious", "happy", "unmotivated"]
INGREDIENTS = ["rice, eggs and spinach", "chicken and potatoes", "pasta and tomatoes", "beans and tortillas"]
THINGS = ["a good book", "a hobby", "a board game", "a podcast about history", "a healthy snack", "a weekend trip"]

TEMPLATES = [
    "Explain {topic} in simple terms.",
    "What is {topic}?",
    "How does {topic} work?",
    "Why is {topic} important?",
    "Give me a short overview of {topic}.",
    "Explain {topic} to {audience}.",
    "List five interesting facts about {topic}.",
    "What are the pros and cons of {topic}?",
    "Write a short poem about {topic}.",
    "Write a haiku about {topic}.",
    "Summarize the history of {topic} in a few sentences.",
    "What are common misconceptions about {topic}?",
    "Give me three tips for {activity}.",
    "How can I get better at {activity}?",
    "Make a step-by-step plan for {activity}.",
    "Write a Python function that {code_task}.",
    "Write a {lang} function that {code_task}.",
    "How do I {code_question} in {lang}?",
    "Rewrite this sentence to be more formal: {sentence}",
    "Fix the grammar in this sentence: {sentence}",
    "Translate this sentence into French: {sentence}",
    "Summarize the following text in one sentence: {paragraph}",
    "Write a short story about {character} who {event}.",
    "Write an email to {recipient} about {subject}.",
    "I'm feeling {mood} today. Any advice?",
    "Can you recommend {thing}?",
    "What should I cook for dinner with {ingredients}?",
    "Compare {topic} and {topic2}.",
    "Write a tweet about {topic}.",
    "Give me a fun fact about {topic}.",
    "What questions should I ask to learn more about {topic}?",
    "Describe {topic} in three sentences.",
]


def build(count: int = 2000, seed: int = 0) -> list[str]:
    """Up to `count` distinct prompts, templates taken in turn, fields drawn with `seed`.

    A template whose fields allow few variants (six moods) stops contributing once a handful of draws
    in a row only repeat what it already gave; the others fill the count.
    """
    rng = random.Random(seed)
    prompts: list[str] = []
    seen: set[str] = set()
    misses = [0] * len(TEMPLATES)
    turn = 0
    while len(prompts) < count and min(misses) < 50:
        index = turn % len(TEMPLATES)
        turn += 1
        if misses[index] >= 50:
            continue
        fields = {
            "topic": rng.choice(TOPICS), "topic2": rng.choice(TOPICS), "audience": rng.choice(AUDIENCES),
            "activity": rng.choice(ACTIVITIES), "code_task": rng.choice(CODE_TASKS), "lang": rng.choice(LANGUAGES),
            "code_question": rng.choice(CODE_QUESTIONS), "sentence": rng.choice(SENTENCES),
            "paragraph": rng.choice(PARAGRAPHS), "character": rng.choice(CHARACTERS), "event": rng.choice(EVENTS),
            "recipient": rng.choice(RECIPIENTS), "subject": rng.choice(SUBJECTS), "mood": rng.choice(MOODS),
            "ingredients": rng.choice(INGREDIENTS), "thing": rng.choice(THINGS),
        }
        prompt = TEMPLATES[index].format(**fields)
        if prompt in seen:
            misses[index] += 1
            continue
        misses[index] = 0
        seen.add(prompt)
        prompts.append(prompt)
    rng.shuffle(prompts)
    return prompts


if __name__ == "__main__":
    for p in build():
        sys.stdout.write(json.dumps({"prompt": p}) + "\n")
