"""Fixed, varied texts for vector-correctness tests (short, long, unicode, numbers, code)."""

VARIED_TEXTS = [
    "hello world",
    "The quick brown fox jumps over the lazy dog.",
    "A man is eating food.",
    "A man is riding a white horse on an enclosed ground.",
    "Embeddings map text to vectors so that similar meanings lie close together.",
    "Ray Serve runs one replica per Ascend 910B card.",
    "Prefix caching reuses the key/value cache of a shared prompt prefix.",
    "Quarterly revenue grew 12% year over year, driven by cloud services.",
    "def add(a, b):\n    return a + b",
    "SELECT name, count(*) FROM users GROUP BY name HAVING count(*) > 1;",
    "Café au lait, naïve résumé, jalapeño — accents and dashes.",
    "東京は日本の首都です。",
    "Привет, как дела?",
    "3.14159 2.71828 1.41421 1.73205",
    "!!! ??? ... ;;;",
    "a",
    "The court held that the contract was void for lack of consideration, and the appeal was "
    "dismissed with costs awarded to the respondent.",
    "Photosynthesis converts light energy into chemical energy stored in glucose molecules.",
    "I love this product, it works perfectly and arrived early!",
    "Terrible service. The package was late and the box was damaged.",
    "The mitochondria is the powerhouse of the cell.",
    "Instruct: Given a web search query, retrieve relevant passages\nQuery: what is vLLM?",
    " ".join(["long input"] * 100),
    "emoji test 🚀🔥✨ with text",
]

# Legal-sounding words for long documents of a chosen length (seeded: the same text every run).
WORDS = ("court contract statute appeal remedy damages tort negligence liability clause party "
         "breach evidence witness judgment precedent jurisdiction tribunal").split()


def doc(n_words: int, seed: int) -> str:
    import random

    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words))
