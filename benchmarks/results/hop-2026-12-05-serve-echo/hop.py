"""Ad hoc: the HTTP round trip of Ray Serve's ingress on this machine, at one request in flight.

  python hop.py deploy     # an echo app (FastAPI ingress, num_cpus 0) at /echo on the running cluster
  python hop.py plain      # the same FastAPI echo under plain uvicorn on :8100 (blocks)
  python hop.py measure    # 5 alternated rounds x 300 sequential POSTs per target; p50s
"""
import asyncio, json, statistics as st, sys, time
from fastapi import FastAPI, Request

api = FastAPI()

@api.post("/")
async def echo(request: Request):
    body = await request.body()
    return {"n": len(body)}

def deploy():
    import ray
    from ray import serve
    ray.init(address="auto", logging_level="ERROR")
    @serve.deployment(ray_actor_options={"num_cpus": 0})
    @serve.ingress(api)
    class Echo:
        pass
    serve.run(Echo.bind(), name="echo", route_prefix="/echo", blocking=False)
    print("deployed")

BODY = {"model": "all-minilm-l6-v2", "input": ["what is the capital of france"], "encoding_format": "base64"}
TARGETS = {"serve-echo": ("http://127.0.0.1:8000", "/echo/"),
           "plain-uvicorn-echo": ("http://127.0.0.1:8100", "/"),
           "embedfleet-1-text": ("http://127.0.0.1:8000", "/v1/embeddings")}

async def measure():
    import httpx
    res = {k: [] for k in TARGETS}
    clients = {k: httpx.AsyncClient(base_url=b, timeout=30) for k, (b, _) in TARGETS.items()}
    for rnd in range(5):
        order = list(TARGETS) if rnd % 2 == 0 else list(reversed(TARGETS))
        for k in order:
            c, path = clients[k], TARGETS[k][1]
            for _ in range(20):
                (await c.post(path, json=BODY)).raise_for_status()
            lat = []
            for _ in range(300):
                t = time.perf_counter(); r = await c.post(path, json=BODY); lat.append(1000 * (time.perf_counter() - t))
                r.raise_for_status()
            res[k].append(round(st.median(lat), 2)); print(rnd, k, res[k][-1], flush=True)
    for k, v in res.items():
        print(f"{k}: p50 per round {v}, median {st.median(v)} ms")
    json.dump(res, open("/tmp/exp3/hop.json", "w"))

if __name__ == "__main__":
    if sys.argv[1] == "deploy": deploy()
    elif sys.argv[1] == "plain":
        import uvicorn; uvicorn.run(api, host="127.0.0.1", port=8100, log_level="warning")
    else: asyncio.run(measure())
