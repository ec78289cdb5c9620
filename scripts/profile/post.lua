-- wrk: the 16-token streaming chat request of `tokenway bench gateway`.
wrk.method = "POST"
wrk.headers["content-type"] = "application/json"
wrk.body = '{"model":"sim-model","stream":true,"max_tokens":16,"messages":[{"role":"user","content":"Say something short about networks and latency."}]}'
