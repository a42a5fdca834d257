import json, glob, re, statistics as st, collections
rows = collections.defaultdict(lambda: collections.defaultdict(list))
for f in sorted(glob.glob("benchmarks/results/lanes-2026-12-05-one-engine/fr-0*.log")):
    d = re.match(r".*/fr-([\d.]+)-(\d)\.log", f).group(1)
    for line in open(f):
        m = re.match(r"repeat \d+/\d+ (\w+): (\{.*\})", line)
        if not m: continue
        r = json.loads(m.group(2)); ph = m.group(1)
        if ph in ("idle", "mixed"):
            rows[d][ph + "_p50"].append(r["interactive_p50_ms"]); rows[d][ph + "_p99"].append(r["interactive_p99_ms"])
            rows[d][ph + "_refused"].append(r["interactive_refused"] + r["interactive_other_failures"])
        if ph in ("bulk", "mixed"):
            rows[d][ph + "_bulk"].append(r["bulk_texts_per_s"])
for d, v in sorted(rows.items(), reverse=True):
    med = {k: round(st.median(x), 1) for k, x in v.items() if not k.endswith("refused")}
    n = len(v["mixed_p99"])
    print(d, "n", n, med, "p99 ratio", round(med["mixed_p99"] / med["idle_p99"], 2),
          "bulk ratio", round(med["mixed_bulk"] / med["bulk_bulk"], 2), "refused", sum(sum(v[k]) for k in v if k.endswith("refused")),
          "mixed p99 range", min(v["mixed_p99"]), max(v["mixed_p99"]), "mixed bulk range", min(v["mixed_bulk"]), max(v["mixed_bulk"]))
