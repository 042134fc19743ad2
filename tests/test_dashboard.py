"""GET /dashboard: the scheduler's ``dashboard`` view (subtrees of a hand-made radix tree against a naive
reference, queues under a fake clock), and the page itself in headless Chromium (Selenium, Debian's chromium and
chromium-driver): against a real server on a tiny checkpoint, one with --api-key and --dp 2, and a stub server
that answers with shadow pairs."""
from __future__ import annotations

import asyncio
import os
import random
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from conftest import get_body, post_json
from radixserve.actors.api.server import added_up
from radixserve.actors.scheduler import Scheduler, SchedulerConfig
from radixserve.actors.scheduler.actor import control
from radixserve.actors.scheduler.dashboard_view import MAX_LISTED, PREVIEW, dashboard_view, tree_view
from radixserve.cache.manager import CacheManager
from radixserve.policies.eviction import LRU
from radixserve.policies.schedule import FCFS
from radixserve.sampling_params import SamplingParams
from radixserve.server_process import ServerProcess
from radixserve.wire.messages import ControlReq
from radixserve.wire.plans import ForwardResult

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
SHADOW_OFF = "shadow policies off (start with --shadow-policies)"


# -- the view, on a hand-made tree ------------------------------------------------------------------------
def cache_with(seqs: list[list[int]], capacity: int = 4096) -> CacheManager:
    cache = CacheManager(capacity, LRU())
    for seq in seqs:
        cache.tree.insert(seq, cache.allocator.alloc(len(seq)))
    return cache


A, B, C, D, E = (list(range(1, 13)), list(range(20, 50)), list(range(60, 68)), list(range(70, 90)),
                 list(range(100, 105)))


def test_subtrees_of_a_hand_made_tree():
    #   root ── A[12] ── B[30] ── C[8]        D locked (so A is too); hits: C twice, D once
    #       │        └── D[20]
    #       └── E[5]
    cache = cache_with([A + B, A + B + C, A + D, E])
    tree = cache.tree
    _, node_c = tree.match_prefix(A + B + C, touch=False)
    _, node_d = tree.match_prefix(A + D, touch=False)
    tree.touch(node_c)
    tree.touch(node_c)
    tree.touch(node_d)
    tree.lock(node_d)
    view = tree_view(tree, top=3)
    assert (view["nodes"], view["tokens"], view["locked_tokens"], view["evictable_tokens"]) == (5, 75, 32, 43)
    largest = view["largest"]
    assert [s["tokens"] for s in largest] == [70, 38, 20]
    a = largest[0]
    assert a == {"tokens": 70, "hits": 3, "locked_tokens": 32, "evictable_tokens": 38, "nodes": 4, "depth": 12,
                 "max_depth": 50, "segment_tokens": 12, "prefix_ids": A, "segment_ids": A}
    b = largest[1]
    assert (b["prefix_ids"], b["segment_ids"]) == ((A + B)[:PREVIEW], B[:PREVIEW])
    assert (b["depth"], b["locked_tokens"], b["hits"]) == (42, 0, 2)
    # hottest: by hits, ties by size; E (never hit) is not listed
    assert [(s["hits"], s["tokens"]) for s in tree_view(tree, top=10)["hottest"]] == [(3, 70), (2, 38), (2, 8),
                                                                                      (1, 20)]
    tree.unlock(node_d)
    assert tree_view(tree)["largest"][0]["locked_tokens"] == 0


def naive_subtrees(tree) -> list[tuple]:
    """Every subtree from first principles: a node's tokens are those of every node it is an ancestor of."""
    def path(node):
        out = []
        while node is not tree.root:
            out.append(node)
            node = node.parent
        return out

    nodes = list(tree.nodes())
    below = {id(n): [m for m in nodes if n in path(m)] for n in nodes}
    rows = []
    for n in nodes:
        sub = below[id(n)]
        head = [t for p in reversed(path(n)) for t in p.tokens][:PREVIEW]
        rows.append((sum(m.num_tokens for m in sub), sum(m.num_tokens for m in sub if m.lock_ref), len(sub),
                     max(m.depth for m in sub), n.depth, n.hit_count, head))
    return sorted(rows)


def test_every_subtree_matches_a_naive_reference():
    rng = random.Random(7)
    for _ in range(20):
        stems = [[rng.randrange(1, 6) for _ in range(rng.randrange(1, 20))] for _ in range(4)]
        seqs = [rng.choice(stems) + [rng.randrange(1, 6) for _ in range(rng.randrange(0, 25))] for _ in range(12)]
        cache = cache_with(seqs)
        tree = cache.tree
        for seq in rng.sample(seqs, 4):
            _, node = tree.match_prefix(seq, touch=False)
            tree.touch(node)
            if rng.random() < 0.5:
                tree.lock(node)
        cache.alloc(cache.allocator.num_free + rng.randrange(0, 30))  # evict a few leaves
        view = tree_view(tree, top=tree.num_nodes)
        got = sorted((s["tokens"], s["locked_tokens"], s["nodes"], s["max_depth"], s["depth"], s["hits"],
                      s["prefix_ids"]) for s in view["largest"])
        assert got == naive_subtrees(tree)
        assert all(s["tokens"] == s["locked_tokens"] + s["evictable_tokens"] for s in view["largest"])


def test_a_deep_tree_needs_no_recursion():
    depth = 3000  # past Python's recursion limit: one node per token, each below the last
    tree = cache_with([], capacity=depth).tree
    seq = list(range(1, depth + 1))
    slots = np.arange(1, depth + 1, dtype=np.int32)
    _, node = tree.insert_from(tree.root, seq[:1], slots[:1])
    for k in range(1, depth):  # each insert from the last leaf (locked, as insert_from wants) adds one node below
        tree.lock(node)
        _, leaf = tree.insert_from(node, seq[: k + 1], slots[: k + 1])
        tree.unlock(node)
        node = leaf
    view = tree_view(tree, top=depth)
    assert view["nodes"] == depth
    top = view["largest"][0]
    assert (top["tokens"], top["nodes"], top["max_depth"], top["prefix_ids"]) == (depth, depth, depth, [1])
    by_depth = {s["depth"]: s for s in view["largest"]}
    assert (by_depth[2]["prefix_ids"], by_depth[2]["segment_ids"], by_depth[2]["tokens"]) == ([1, 2], [2], depth - 1)
    assert (by_depth[900]["prefix_ids"], by_depth[900]["segment_ids"]) == (seq[:PREVIEW], [900])


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_scheduler(clock: Clock, disable: bool = False) -> Scheduler:
    cfg = SchedulerConfig(context_length=4096, vocab_size=50, eos_ids=frozenset({0}), max_running_requests=4,
                          chunked_prefill_size=16, check_invariants=True)
    return Scheduler(cfg, CacheManager(512, LRU(), disable_radix_cache=disable, clock=clock), FCFS(), clock=clock)


def step(sched: Scheduler) -> None:
    plan = sched.schedule()
    sched.process(ForwardResult(plan.step, [7] * int(np.count_nonzero(plan.sample))))


def test_queues_running_chunked_and_waiting():
    clock = Clock()
    sched = make_scheduler(clock)
    params = SamplingParams(max_new_tokens=5, ignore_eos=True)
    sched.add_request("short", [1, 2, 3], params, priority=2)
    clock.now += 1
    step(sched)  # "short" runs (3 tokens prefilled, one generated)
    sched.add_request("long", list(range(1, 41)), params)  # 40 tokens, chunked, 16 a step; reuses short's 3
    clock.now += 2
    sched.add_request("later", [4, 5, 6], params)
    clock.now += 0.5
    step(sched)  # "short" waits while "long" takes the step's budget (16) in its first chunk
    queues = dashboard_view(sched)["queues"]
    assert (queues["running_count"], queues["waiting_count"]) == (2, 1)
    assert queues["running"] == [
        {"rid": "long", "state": "prefilling", "prompt_tokens": 40, "cached_tokens": 3, "output_tokens": 0,
         "wait_s": 2.5, "priority": 0},
        {"rid": "short", "state": "decoding", "prompt_tokens": 3, "cached_tokens": 0, "output_tokens": 1,
         "wait_s": 3.5, "priority": 2}]
    assert queues["waiting"] == [{"rid": "later", "state": "waiting", "prompt_tokens": 3, "cached_tokens": None,
                                  "output_tokens": 0, "wait_s": 0.5, "priority": 0}]
    for i in range(MAX_LISTED + 10):
        sched.add_request(f"q{i}", [9, i % 40 + 1], params)
    queues = dashboard_view(sched)["queues"]
    assert queues["waiting_count"] == MAX_LISTED + 11 and len(queues["waiting"]) == MAX_LISTED
    assert [r["rid"] for r in queues["waiting"][:2]] == ["later", "q0"], "arrival order"


def test_control_op_and_no_radix_cache():
    clock = Clock()
    sched = make_scheduler(clock, disable=True)
    sched.add_request("a", [1, 2, 3], SamplingParams(max_new_tokens=2))
    reply = control(sched, ControlReq(3, "dashboard"))
    assert reply.reply_id == 3 and reply.error is None
    assert reply.body["tree"] is None and reply.body["queues"]["waiting_count"] == 1
    with_tree = make_scheduler(clock)
    step_body = control(with_tree, ControlReq(4, "dashboard")).body
    assert step_body["tree"]["largest"] == [] and step_body["tree"]["nodes"] == 0
    # --dp: the api adds the replicas' counts up; lists and None do not add, and nothing breaks
    total = added_up([reply.body, step_body])
    assert total["queues"] == {"running_count": 0, "waiting_count": 1}


# -- the page in a browser -----------------------------------------------------------------------------------
def chrome():
    """Headless Chromium from Debian's packages (never a downloaded one); fails in CI, skips elsewhere, with the
    reason, when it is not installed (`make test` installs it when run as root)."""
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not os.path.exists(p)]
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        missing.append("the selenium package (pip install -e '.[test]')")
    if missing:
        reason = (f"the dashboard's browser test needs {', '.join(missing)}: `make test` installs chromium and "
                  "chromium-driver when run as root, else `sudo apt-get install chromium chromium-driver`")
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1400,1600"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)


@pytest.fixture(scope="module")
def chromium():
    driver = chrome()
    yield driver
    driver.quit()


@pytest.fixture
def browser(chromium):
    """The module's browser on a blank page, its console log emptied (the last test's page polls no more)."""
    chromium.get("about:blank")
    chromium.get_log("browser")
    yield chromium
    chromium.get("about:blank")


def wait_for(driver, condition, what: str, timeout: float = 15):
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    try:  # the page re-renders every second: an element found a moment ago may be gone, so look again
        return WebDriverWait(driver, timeout, poll_frequency=0.1,
                             ignored_exceptions=(StaleElementReferenceException,)).until(lambda d: condition())
    except Exception as exc:
        raise AssertionError(f"the page never showed {what}; it says: {text(driver, 'message')!r}, "
                             f"log: {driver.get_log('browser')}") from exc


def settled(read):
    """What ``read`` reads off the page, read again where the page re-rendered under it (a stale element)."""
    from selenium.common.exceptions import StaleElementReferenceException

    for _ in range(50):
        try:
            return read()
        except StaleElementReferenceException:
            time.sleep(0.05)
    return read()


def text(driver, element_id: str) -> str:
    return settled(lambda: driver.find_element("id", element_id).text)


def cell(driver, table: str, col: str, row: int | str = 1):
    """A table's cell by row (from 1, or "last") and column key."""
    nth = "last-child" if row == "last" else f"nth-child({row})"
    return driver.find_element("css selector", f"#{table} tbody tr:{nth} td[data-col='{col}']")


def severe(driver, allowed: str | None = None) -> list[dict]:
    """The browser's console errors (a network answer containing ``allowed`` excepted)."""
    return [e for e in driver.get_log("browser") if e["level"] == "SEVERE"
            and not (allowed and e.get("source") == "network" and allowed in e["message"])]


def percent(value: float) -> float:
    return round(100 * value, 1)


def shown_percent(element) -> float:
    return float(element.text.rstrip("%"))


def get_auth(url: str, key: str | None = None):
    if key is None:
        return get_body(url)
    import json

    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.load(resp)


SHARED = "You are a helpful assistant who answers in one short sentence, always politely and precisely. "


def test_dashboard_shows_the_live_server_and_switches_policies(browser, tiny_server):
    url = tiny_server.url  # shared with other tests: its totals are whatever they left, the tree is flushed
    post_json(url + "/policies", {"eviction": "lru"})
    post_json(url + "/flush_cache", {})
    for i in range(4):  # one shared prefix: the whole tree is one subtree under it
        post_json(url + "/generate", {"text": SHARED + f"Question {i}?",
                                      "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    stats, state = get_body(url + "/cache/stats"), get_body(url + "/dashboard/state")
    for name in ("..%2Fdashboard.py", "dashboard.html", "%2E%2E%2Fapp.py"):  # only the page's own files
        with pytest.raises(urllib.error.HTTPError) as missing:
            get_body(f"{url}/dashboard/{name}")
        assert missing.value.code == 404
    epoch = stats["epochs"][-1]
    assert epoch["current"] and epoch["requests"] >= 4 and epoch["cached_tokens"] > 0
    browser.get(url + "/dashboard")
    wait_for(browser, lambda: "live" in browser.find_element("id", "conn").get_attribute("class"), "live numbers")
    finished = stats["totals"]["requests_finished"]
    wait_for(browser, lambda: text(browser, "totals-requests") == f"{finished:,}", "the finished requests")
    assert shown_percent(browser.find_element("id", "totals-hit_rate")) == percent(stats["totals"]["hit_rate"])
    assert cell(browser, "epochs", "requests", "last").text == f"{epoch['requests']:,}"
    assert shown_percent(cell(browser, "epochs", "hit_rate", "last")) == percent(epoch["hit_rate"])
    pool = stats["pool"]
    assert int(browser.find_element("id", "pool-free").get_attribute("data-value")) == pool["free"]
    largest = state["tree"]["largest"][0]
    assert largest["tokens"] == pool["evictable"] + pool["protected"], "one subtree holds the whole tree"
    assert int(cell(browser, "tree-largest", "tokens").get_attribute("data-value")) == largest["tokens"]
    assert cell(browser, "tree-largest", "prefix").text.startswith(" ".join(map(str, largest["prefix_ids"])))
    hottest = state["tree"]["hottest"][0]
    assert int(cell(browser, "tree-hottest", "hits").get_attribute("data-value")) == hottest["hits"] >= 3
    assert text(browser, "shadow-status") == SHADOW_OFF
    assert "no running requests" in text(browser, "running")
    assert browser.find_element("id", "hit-chart").size["height"] > 100

    from selenium.webdriver.support.ui import Select

    Select(browser.find_element("id", "eviction-select")).select_by_value("lfu")
    browser.find_element("id", "switch-button").click()
    wait_for(browser, lambda: "switched" in text(browser, "policy-reply"), "the server's reply")
    try:
        assert get_body(url + "/policies")["eviction"]["current"] == "lfu"
        epochs = get_body(url + "/cache/stats")["epochs"]
        wait_for(browser, lambda: cell(browser, "epochs", "index", "last").text == str(len(epochs))
                 and text(browser, "current-eviction") == "lfu", "the new epoch")
        assert cell(browser, "epochs", "eviction", "last").text == "lfu"
        assert browser.find_element("css selector", "#epochs tbody tr:last-child").get_attribute("class") == "current"
        assert severe(browser) == []
    finally:
        post_json(url + "/policies", {"eviction": "lru"})


def test_dashboard_with_an_api_key_and_replicas(browser, tiny_models):
    server = ServerProcess("--model-path", str(tiny_models["llama"]), "--dtype", "float32",
                           "--max-total-tokens", "1200", "--api-key", "sesame", "--dp", "2")
    try:
        url = server.url
        with urllib.request.urlopen(url + "/dashboard/dashboard.js") as resp:  # the page's files are open
            assert resp.status == 200
        with pytest.raises(urllib.error.HTTPError) as denied:  # its data is not
            get_body(url + "/dashboard/state")
        assert denied.value.code == 401
        req = urllib.request.Request(url + "/generate", headers={"Content-Type": "application/json",
                                                                 "Authorization": "Bearer sesame"},
                                     data=b'{"text": "key test", "sampling_params": {"max_new_tokens": 3}}')
        urllib.request.urlopen(req, timeout=60).read()
        browser.get(url + "/dashboard")
        wait_for(browser, lambda: "needs an API key" in text(browser, "message"), "the 401 message")
        key = browser.find_element("id", "api-key")
        key.send_keys("wrong")
        browser.find_element("id", "key-save").click()
        wait_for(browser, lambda: "refused the API key" in text(browser, "message"), "the refusal")
        key.clear()
        key.send_keys("sesame")
        browser.find_element("id", "key-save").click()
        wait_for(browser, lambda: "live" in browser.find_element("id", "conn").get_attribute("class"), "live numbers")
        stats = get_auth(url + "/cache/stats", "sesame")
        assert "replicas" in stats and "total" in stats
        wait_for(browser, lambda: text(browser, "totals-requests") == str(stats["totals"]["requests_finished"]),
                 "replica 0's requests")
        assert text(browser, "replicas") == "--dp 2: replica 0 shown"
        assert not browser.find_element("id", "message").is_displayed()
        browser.refresh()  # the key is kept for the session
        wait_for(browser, lambda: "live" in browser.find_element("id", "conn").get_attribute("class"), "live again")
        assert severe(browser, allowed="401") == []
    finally:
        server.stop()


# -- the page against a stub server: shadow pairs on, replicas, no radix cache -----------------------------
class StubServer:
    """What DashboardRoutes asks of the ApiServer: ``control("dashboard")``."""

    class Reply:
        def __init__(self, body: dict) -> None:
            self.body = body

    async def control(self, op: str, **kw) -> StubServer.Reply:
        assert op == "dashboard"
        queue = {"rid": "<b>not markup</b>", "state": "waiting", "prompt_tokens": 9, "cached_tokens": None,
                 "output_tokens": 0, "wait_s": 1.5, "priority": 0}
        return self.Reply({"tree": None, "queues": {"running_count": 0, "waiting_count": 1, "running": [],
                                                    "waiting": [queue]}})


def pair(eviction: str, schedule: str, hit: float, live: bool = False) -> dict:
    return {"eviction": eviction, "schedule": schedule, "live": live, "requests": 40, "hit_rate": hit,
            "evicted_tokens": 100, "ttft_p50_s": 0.01, "ttft_p99_s": 0.2, "ttft_mean_s": 0.03,
            "cold_ttft_p99_s": 0.3, "max_queue_wait_s": 0.5, "slowest5_ttft_share": 0.2}


SHADOW_ON = {"enabled": True, "window_s": 60.0, "lag_s": 0.5, "live": {"eviction": "lru", "schedule": "fcfs"},
             "leader": {"eviction": "lfu", "schedule": "lpm"}, "auto_policy": False,
             "switches": [{"at": 12.5, "from": {"eviction": "lru", "schedule": "lpm"},
                           "to": {"eviction": "lru", "schedule": "fcfs"}, "reason": "manual"}],
             "pairs": [pair("lru", "fcfs", 0.4, live=True), pair("lfu", "lpm", 0.7)]
             + [pair(f"plugin-{i}", "fcfs", 0.5) for i in range(24)]}  # more than the page lists


def stub_app(shadow: dict):
    from aiohttp import web

    from radixserve.actors.api.dashboard import DashboardRoutes

    epoch = {"eviction": "lru", "schedule": "fcfs", "started": 5.0, "duration_s": 2.0, "current": True,
             "requests": 3, "prompt_tokens": 30, "cached_tokens": 0, "hit_rate": 0.0, "evicted_tokens": 0,
             "generated_tokens": 6, "throughput_tokens_per_s": 3.0, "ttft_p50_s": None, "ttft_p99_s": None,
             "ttft_mean_s": None, "cold_requests": 3, "cold_ttft_p99_s": None, "max_queue_wait_s": None,
             "slowest5_ttft_share": None}
    one = {"pool": {"capacity": 100, "free": 100, "evictable": 0, "protected": 0, "owned_by_requests": 0},
           "totals": {"requests_finished": 3, "hit_rate": 0.0}, "epochs": [epoch]}
    stats = {**one, "replicas": {"0": one, "1": one}, "total": {"pool": {"capacity": 200}}}
    policies = {"eviction": {"current": "lru", "available": ["lfu", "lru"]},
                "schedule": {"current": "fcfs", "available": ["fcfs", "lpm"]}, "errors": []}

    def answer(body):
        async def handler(request):
            return web.json_response(body)
        return handler

    app = web.Application()
    DashboardRoutes(StubServer()).add_to(app)
    app.router.add_get("/cache/stats", answer(stats))
    app.router.add_get("/policies", answer(policies))
    async def shadow_now(request):
        return web.json_response(shadow)

    app.router.add_get("/policies/shadow", shadow_now)
    return app


@pytest.fixture
def stub():
    """The stub app on a free port, served from a thread; yields its url and the shadow body (change it to
    change what the page gets)."""
    from aiohttp import web

    shadow = dict(SHADOW_ON)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(stub_app(shadow))
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", 0).start())
    port = runner.addresses[0][1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{port}", shadow
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def test_dashboard_shows_shadow_pairs(browser, stub):
    url, shadow = stub
    browser.get(url + "/dashboard")
    # the best 20 by hit rate (the leader first), and the live pair although it ranks last
    wait_for(browser, lambda: len(browser.find_elements("css selector", "#shadow-pairs tbody tr")) == 21, "the pairs")
    assert text(browser, "shadow-status").startswith("live lru / fcfs, leader lfu / lpm")
    assert text(browser, "shadow-shown").startswith("21 of 26 pairs shown")
    rows = settled(lambda: [r.get_attribute("class")
                            for r in browser.find_elements("css selector", "#shadow-pairs tbody tr")])
    assert rows == ["leader"] + [""] * 19 + ["current"]
    marks = settled(lambda: [cell(browser, "shadow-pairs", "mark", i).text for i in (1, 2, 21)])
    assert marks == ["leader", "", "live"]
    assert settled(lambda: shown_percent(cell(browser, "shadow-pairs", "hit_rate", 1))) == 70.0
    assert "manual" in text(browser, "shadow-switches")
    legend = settled(lambda: [e.text for e in browser.find_elements("css selector", "#shadow-legend .legend-item")])
    assert legend == ["lfu / lpm"] + [f"plugin-{i} / fcfs" for i in range(7)] + ["lru / fcfs"]
    assert text(browser, "replicas") == "--dp 2: replica 0 shown"
    assert "radix cache is off" in text(browser, "tree-summary")
    assert settled(lambda: cell(browser, "waiting", "rid").text) == "<b>not markup</b>", "client text stays text"
    wait_for(browser, lambda: cell(browser, "epochs", "ttft_p50_s").text == "\u2013", "no TTFT yet")
    shadow.clear()
    shadow.update({"enabled": False, "pairs": []})
    wait_for(browser, lambda: text(browser, "shadow-status") == SHADOW_OFF, "shadow off")
    assert not browser.find_element("id", "shadow-body").is_displayed()
    assert severe(browser) == []


def test_dashboard_shows_the_kv_tiers_and_switches_the_write_policy(browser, tiny_models, tmp_path):
    import json

    server = ServerProcess("--model-path", str(tiny_models["llama"]), "--dtype", "float32", "--max-total-tokens",
                           "700", "--enable-hierarchical-cache", "--page-size", "16",
                           "--hicache-storage-backend-extra-config", json.dumps({"path": str(tmp_path)}))
    try:
        prompts = [[random.Random(s).randrange(100, 5000) for _ in range(200)] for s in range(5)]
        for ids in prompts * 2:  # five 200-token prompts through a 700-token pool, twice: the second round's come
            post_json(server.url + "/generate", {"input_ids": ids,  # back from host memory
                                                 "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
        tiers = get_body(server.url + "/cache/stats")["tiers"]
        assert tiers["hit_rate"]["L2"] > 0
        browser.get(server.url + "/dashboard")
        wait_for(browser, lambda: browser.find_element("id", "tiers-panel").is_displayed(), "the tiers panel")
        wait_for(browser, lambda: shown_percent(browser.find_element("id", "tiers-L2"))
                 == percent(tiers["hit_rate"]["L2"]), "host memory's hit rate")
        assert text(browser, "current-write") == "write_through"

        from selenium.webdriver.support.ui import Select

        Select(browser.find_element("id", "write-select")).select_by_value("write_back")
        browser.find_element("id", "switch-button").click()
        wait_for(browser, lambda: "write write_back" in text(browser, "policy-reply"), "the server's reply")
        assert get_body(server.url + "/policies")["write"]["current"] == "write_back"
        wait_for(browser, lambda: text(browser, "current-write") == "write_back", "the new write policy")
        assert severe(browser) == []
    finally:
        server.stop()


def test_dashboard_shows_speculative_decoding_and_switches_the_draft_policy(browser, tiny_models):
    server = ServerProcess("--model-path", str(tiny_models["llama"]), "--dtype", "float32",
                           "--speculative-algorithm", "suffix", "--speculative-num-draft-tokens", "6")
    try:
        rng = random.Random(4)
        phrase = [rng.randrange(100, 5000) for _ in range(24)]
        for _ in range(3):  # the same prompt again: the suffix trie holds the earlier answer, drafts are kept
            post_json(server.url + "/generate", {"input_ids": phrase * 3,
                                                 "sampling_params": {"max_new_tokens": 24, "temperature": 0}})
        spec = get_body(server.url + "/cache/stats")["speculative"]
        assert spec["accepted"] > 0
        browser.get(server.url + "/dashboard")
        wait_for(browser, lambda: browser.find_element("id", "speculative-panel").is_displayed(), "the panel")
        wait_for(browser, lambda: shown_percent(browser.find_element("id", "speculative-acceptance"))
                 == percent(spec["acceptance_rate"]), "the acceptance rate")
        assert text(browser, "speculative-policy") == "suffix / 6"
        assert text(browser, "current-draft") == "suffix"

        from selenium.webdriver.support.ui import Select

        Select(browser.find_element("id", "draft-select")).select_by_value("none")
        browser.find_element("id", "switch-button").click()
        wait_for(browser, lambda: "draft none" in text(browser, "policy-reply"), "the server's reply")
        assert "epoch" not in text(browser, "policy-reply")
        assert get_body(server.url + "/policies")["draft"]["current"] == "none"
        wait_for(browser, lambda: text(browser, "speculative-policy") == "none / 6", "drafting off, still shown")
        assert severe(browser) == []
    finally:
        server.stop()
