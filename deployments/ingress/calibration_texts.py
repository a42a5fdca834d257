"""The fixed texts an ingress embeds once per model to measure its int8/uint8 ranges.

Why these: int8 and uint8 map each dimension's [min, max] onto 256 buckets, so what matters is
that the extremes of each dimension are reached about as far as real traffic reaches them. Those
extremes are mostly a property of the model (of its normalised output space), not of the topic,
so a few hundred varied texts bound almost every value; what the set must avoid is being narrow
(one topic, one length, one language), which would leave whole regions of the space unvisited and
clip them. So the set mixes short search queries and keyword strings, questions, one-line facts,
longer passages, product and news prose, code and logs, numbers and tables, and a few languages
(Chinese above all: the 910B fleet's users), in the proportions a retrieval index sees them.

The set is part of the code: changing it changes the ranges, and so the digest in the
``x-embedfleet-int8-ranges`` header. Ranges that must be identical across every ingress and
release belong in the model's config (``encodings.int8_ranges_file``).
"""

from __future__ import annotations

QUERIES = (
    "how to reset a forgotten router password",
    "best hiking trails near zurich",
    "symptoms of vitamin d deficiency",
    "python sort list of dicts by key",
    "cheap flights london to new york december",
    "what is the capital of australia",
    "kubernetes pod stuck in pending state",
    "chocolate chip cookie recipe without eggs",
    "difference between stocks and bonds",
    "who wrote the brothers karamazov",
    "how long to boil an egg",
    "weather tomorrow in tokyo",
    "postgres vacuum full vs vacuum",
    "why is the sky blue",
    "tax deadline for freelancers in germany",
    "rust borrow checker lifetime error",
    "how many calories in a banana",
    "replace kitchen faucet cartridge",
    "symptoms of burnout at work",
    "meaning of the word serendipity",
    "translate good morning to spanish",
    "fastest way to learn touch typing",
    "nba finals 2019 winner",
    "ascend 910b memory bandwidth",
    "vector database hnsw parameters ef construction",
    "how do vaccines train the immune system",
    "dog keeps scratching ears",
    "electric car battery lifespan in cold weather",
    "mortgage refinance calculator",
    "git undo last commit keep changes",
    "华为昇腾910B 显存多大",
    "北京到上海高铁多长时间",
    "如何提高睡眠质量",
    "comment faire une pâte à crêpes",
    "wie funktioniert eine wärmepumpe",
    "東京 おすすめ ラーメン",
    "qué es la inflación",
    "cover letter template software engineer",
    "signs of a failing hard drive",
    "protein intake for muscle gain",
)

FACTS = (
    "The Eiffel Tower was completed in 1889 for the World's Fair in Paris.",
    "Water boils at 100 degrees Celsius at sea level.",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "The mitochondria produce most of the cell's supply of ATP.",
    "Mount Everest is the highest mountain above sea level, at 8,849 metres.",
    "The human heart beats roughly 100,000 times a day.",
    "Shakespeare wrote Hamlet around the year 1600.",
    "The speed of light in a vacuum is about 299,792 kilometres per second.",
    "Honey never spoils if it is kept sealed.",
    "The Great Wall of China stretches over thousands of kilometres.",
    "Octopuses have three hearts and blue blood.",
    "The Pacific is the largest and deepest of the world's oceans.",
    "Bitcoin was introduced in a white paper published in 2008.",
    "The first human landing on the Moon took place in July 1969.",
    "An interest rate rise usually makes borrowing more expensive.",
    "Penicillin was discovered by Alexander Fleming in 1928.",
    "Most of the Earth's fresh water is locked in ice sheets and glaciers.",
    "A leap year has 366 days, with February 29 added.",
    "The Amazon rainforest produces a large share of the world's oxygen.",
    "Transformers process all tokens of a sequence in parallel using attention.",
    "长城是中国古代的军事防御工程。",
    "人工智能正在改变医疗、金融和制造业。",
    "La Seine traverse Paris avant de se jeter dans la Manche.",
    "Der Rhein ist einer der längsten Flüsse Europas.",
    "El Quijote es una novela escrita por Miguel de Cervantes.",
    "富士山は日本で最も高い山です。",
)

QUESTIONS = (
    "Can I bring a power bank in my checked luggage?",
    "Why does my sourdough starter smell like acetone?",
    "Is it safe to run a dishwasher overnight while sleeping?",
    "What happens to my pension if I move to another country?",
    "How do I tell my manager I am overwhelmed without sounding incompetent?",
    "Which is better for a small office, a NAS or cloud storage?",
    "Should I stretch before or after running?",
    "Why did the Roman Empire fall?",
    "How does a heat exchanger work in a ventilation system?",
    "What is the time complexity of inserting into a binary heap?",
    "Does the order of arguments matter in a SQL JOIN?",
    "How can I stop my cat from scratching the sofa?",
    "为什么模型推理时显存占用会越来越高？",
    "¿Cuánto tiempo tarda en llegar un paquete internacional?",
)

PASSAGES = (
    "Our return policy allows customers to return most items within 30 days of delivery for a "
    "full refund. Items must be unused and in their original packaging. Refunds are issued to "
    "the original payment method within five business days of receiving the return.",
    "The committee met on Tuesday to discuss the budget for the coming fiscal year. After a long "
    "debate, members agreed to increase spending on public transport while postponing the "
    "renovation of the town hall until further funding is secured.",
    "To install the package, run the installer with administrator rights and follow the "
    "prompts. If the installation fails with error 1603, make sure no previous version is "
    "running and that the target folder is writable, then restart the computer and try again.",
    "The patient, a 54-year-old man with a history of hypertension, presented with chest pain "
    "radiating to the left arm. An electrocardiogram showed ST elevation in the anterior leads, "
    "and he was taken to the catheterisation laboratory for primary angioplasty.",
    "This lightweight rain jacket is made from recycled nylon with a waterproof, breathable "
    "membrane. It packs into its own pocket, has adjustable cuffs and a hood with a stiffened "
    "brim, and comes in five colours and sizes from XS to XXL.",
    "Quarterly revenue rose 12 percent year over year to 4.2 billion dollars, driven by strong "
    "demand for cloud services, while operating margin narrowed slightly because of higher "
    "spending on data centres and research.",
    "In the beginning the village had only a well, a chapel and a handful of stone houses. Over "
    "the centuries it grew along the river, and by the time the railway arrived it had become "
    "a market town known for its wool and its cheese.",
    "Gradient descent updates the parameters of a model in the direction that most reduces the "
    "loss. The learning rate controls the size of each step: too large and training diverges, "
    "too small and it converges slowly or gets stuck in poor regions of the loss surface.",
    "The tenant shall pay the rent monthly in advance on the first day of each month. Late "
    "payments incur a fee of five percent of the monthly rent. The landlord is responsible for "
    "structural repairs; the tenant for minor maintenance and keeping the premises clean.",
    "Scientists have observed that some species of coral can recover from bleaching events if "
    "water temperatures return to normal quickly, but repeated heat waves leave less time for "
    "recovery, and reefs that bleach every few years are slowly replaced by algae.",
    "A stable vector index needs embeddings that do not drift: the same text must map to the "
    "same vector whether it is embedded alone or in a batch, today or after an upgrade, or "
    "nearest-neighbour results will change for reasons that have nothing to do with the data.",
    "The match ended in a 2-2 draw after the visitors scored a late equaliser from a corner. "
    "The home side had dominated the first half and led through goals from their captain and "
    "a young striker making his debut, but faded after the break.",
    "向量数据库通过近似最近邻搜索在海量嵌入中快速找到与查询最相似的文档。常见的索引结构包括 HNSW、"
    "IVF 和乘积量化，它们在召回率、延迟和内存之间做出不同的权衡。",
    "昇腾910B是华为推出的人工智能训练与推理芯片，配合 CANN 软件栈和 vllm-ascend 插件，可以运行"
    "大语言模型和文本嵌入模型的在线服务。",
    "本公司承诺在收到退货后七个工作日内完成退款，退款将原路返回至支付账户。如有疑问，请联系客服。",
    "Le projet vise à réduire la consommation d'énergie des bâtiments publics de trente pour cent "
    "d'ici à 2030, grâce à l'isolation, au remplacement des chaudières et à l'installation de "
    "panneaux solaires sur les toits.",
    "Die Studie zeigt, dass regelmäßige Bewegung das Risiko für Herz-Kreislauf-Erkrankungen "
    "deutlich senkt, unabhängig von Alter und Geschlecht der Teilnehmer.",
)

TECHNICAL = (
    "def merge(a, b):\n    out = []\n    while a and b:\n        out.append((a if a[0] < b[0] "
    "else b).pop(0))\n    return out + a + b",
    "SELECT customer_id, SUM(amount) AS total FROM orders WHERE created_at >= '2024-01-01' "
    "GROUP BY customer_id ORDER BY total DESC LIMIT 10;",
    "ERROR 2025-03-14T09:21:07Z worker-3 connection reset by peer (retry 2/5) upstream=10.0.4.17:8443",
    "Traceback (most recent call last):\n  File \"app.py\", line 42, in handler\n    "
    "return data['items'][0]\nKeyError: 'items'",
    "kubectl rollout restart deployment/api -n production && kubectl rollout status "
    "deployment/api -n production",
    "{\"id\": 4812, \"status\": \"shipped\", \"items\": [{\"sku\": \"A-113\", \"qty\": 2}], "
    "\"total\": 59.90}",
    "fn main() { let v: Vec<u32> = (1..=10).filter(|x| x % 2 == 0).collect(); println!(\"{:?}\", v); }",
    "| model | params | dim |\n|---|---|---|\n| MiniLM-L6 | 22M | 384 |\n| Qwen3-Embedding-8B | 8B | 4096 |",
    "sudo apt-get update && sudo apt-get install -y build-essential libssl-dev",
    "The function returns 0 on success and a negative errno value on failure; EAGAIN means the "
    "queue is full and the caller should retry after the next completion event.",
    "HTTP/1.1 429 Too Many Requests\nRetry-After: 2\nContent-Type: application/json",
    "x = np.linalg.solve(A.T @ A + lam * np.eye(A.shape[1]), A.T @ b)",
)

SHORT = (
    "thanks!", "Order #88213 delivered", "red running shoes size 42", "OK", "404 not found",
    "Q3 2024 earnings call transcript", "2 cups flour, 1 tsp salt, 3 eggs", "¡Feliz cumpleaños!",
    "谢谢", "meeting moved to 3pm", "iPhone 15 Pro Max 256GB", "BRCA1 mutation",
    "lorem ipsum dolor sit amet", "42", "café au lait", "unsubscribe",
)

CALIBRATION_TEXTS: tuple[str, ...] = QUERIES + FACTS + QUESTIONS + PASSAGES + TECHNICAL + SHORT
