"""Ad hoc: embed-corpus --inflight 2 vs 4, 5 alternated pairs, texts/s and machine CPU-s per 1k."""
import subprocess, time, re, json, statistics as st
def busy():
    v = list(map(int, open('/proc/stat').readline().split()[1:])); return (sum(v) - v[3] - v[4]) / 100
res = {2: [], 4: []}
for i in range(5):
    for n in ((2, 4) if i % 2 == 0 else (4, 2)):
        subprocess.run("rm -rf /tmp/exp3/out-ab", shell=True)
        b0 = busy()
        out = subprocess.run(["embedfleet", "embed-corpus", "/tmp/exp3/corpus.jsonl", "--model", "all-minilm-l6-v2",
                              "--out", "/tmp/exp3/out-ab", "--inflight", str(n)], capture_output=True, text=True).stdout
        cpu = busy() - b0
        r = float(re.search(r"\(([\d,.]+) texts/s\)", out).group(1).replace(",", ""))
        res[n].append((r, round(cpu / 10, 2))); print(i, n, r, round(cpu / 10, 2), flush=True)
for n, v in res.items():
    print(n, "median texts/s", st.median(x for x, _ in v), "cpu-s/1k", st.median(c for _, c in v))
json.dump(res, open("/tmp/exp3/inflight_ab.json", "w"))
