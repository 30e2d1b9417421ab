"""Keys, TLS and exposure of a real `PdServer` (one prefill and one decode worker as Ray actors) started with an
API key, an admin key and mutual TLS, with certificates made here by the `openssl` command: no key or a wrong
key is refused on every gRPC method and HTTP endpoint but health, the API key cannot scale, drain or read
status, clients without a certificate the CA signed cannot connect; no socket of ours listens on the wildcard
address; an anonymous client of the KV store cannot find or move the keys the workers use."""

from __future__ import annotations

import datetime
import json
import os
import re
import shutil
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.request

import grpc
import httpx2
import openai
import pytest
import torch.distributed as dist
from serving import listening, sockets_of, start_server

from pdserve.cli.client import Client, format_status, generate_request
from pdserve.cluster.config import SecurityConfig, build_config
from pdserve.cluster.errors import PermissionDeniedError, UnauthenticatedError
from pdserve.cluster.ray_connect import is_loopback
from pdserve.frontend.security import Credentials, check_exposure, open_doors_warning
from pdserve.frontend.validation import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from pdserve.model.errors import ConfigError
from pdserve.v1 import generation_pb2

API_KEY = "test-api-key-0123456789"
ADMIN_KEY = "test-admin-key-9876543210"
pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")


def _openssl(*args: str, cwd) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _signed(name: str, cn: str, extensions: str, cwd) -> None:
    """name.key and name.pem, signed by ca.pem."""
    (cwd / f"{name}.ext").write_text(extensions)
    _openssl(
        "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={cn}", cwd=cwd,
    )  # fmt: skip
    _openssl(
        "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
        "-CAcreateserial", "-days", "1", "-out", f"{name}.pem", "-extfile", f"{name}.ext", cwd=cwd,
    )  # fmt: skip


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate, made by openssl."""
    d = tmp_path_factory.mktemp("certs")
    _openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", "ca.key", "-out", "ca.pem", "-days", "1", "-subj", "/CN=pdserve test CA",
        "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign",
        cwd=d,
    )  # fmt: skip
    _signed(
        "server", "localhost",
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n", d,
    )  # fmt: skip
    _signed("client", "pdserve test client", "extendedKeyUsage=clientAuth\n", d)
    return {name: str(d / name) for name in os.listdir(d)}


@pytest.fixture(scope="module")
def server(ray_cluster, model_dir, certs):
    security = {
        "api_key": API_KEY, "admin_key": ADMIN_KEY, "tls_cert": certs["server.pem"],
        "tls_key": certs["server.key"], "tls_client_ca": certs["ca.pem"],
    }  # fmt: skip
    with start_server(model_dir, router={"http_port": 0}, security=security) as server:
        yield server


def client(server, certs, key: str | None = None, cert: bool = True) -> Client:
    mtls = {"tls_cert": certs["client.pem"], "tls_key": certs["client.key"]} if cert else {}
    return Client(server.address, key=key, tls_ca=certs["ca.pem"], **mtls)


def http(certs, cert: bool = True) -> httpx2.Client:
    verify = ssl.create_default_context(cafile=certs["ca.pem"])
    if cert:
        verify.load_cert_chain(certs["client.pem"], certs["client.key"])
    return httpx2.Client(verify=verify, timeout=60)


def api(server, certs, key: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=server.http_url, api_key=key, max_retries=0, http_client=http(certs)
    )


# Keys.


def test_credentials_decide_by_key_and_kind_of_call(monkeypatch):
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    monkeypatch.delenv("PDSERVE_ADMIN_KEY", raising=False)
    both = Credentials.resolve(SecurityConfig(api_key="a" * 20, admin_key="b" * 20))
    both.check("Bearer " + "a" * 20, admin=False)
    both.check("Bearer " + "b" * 20, admin=False)
    both.check("bearer " + "b" * 20, admin=True)
    for header in (None, "", "Bearer ", "Basic " + "a" * 20, "Bearer " + "a" * 19, "a" * 20):
        with pytest.raises(UnauthenticatedError):
            both.check(header, admin=False)
    with pytest.raises(PermissionDeniedError, match="cannot make admin calls"):
        both.check("Bearer " + "a" * 20, admin=True)
    api_only = Credentials.resolve(SecurityConfig(api_key="a" * 20))
    with pytest.raises(PermissionDeniedError, match="has none"):
        api_only.check("Bearer " + "a" * 20, admin=True)
    Credentials.resolve(SecurityConfig()).check(None, admin=True)  # no keys: open
    admin_only = Credentials.resolve(SecurityConfig(admin_key="b" * 20))
    admin_only.check(None, admin=False)
    with pytest.raises(UnauthenticatedError):
        admin_only.check(None, admin=True)
    monkeypatch.setenv("PDSERVE_API_KEY", "from-env")
    Credentials.resolve(SecurityConfig()).check("Bearer from-env", admin=False)
    with pytest.raises(UnauthenticatedError):
        Credentials.resolve(SecurityConfig()).check("Bearer other", admin=False)


def test_key_files_and_bad_security_config_raise_naming_the_field(tmp_path, monkeypatch):
    path = tmp_path / "key"
    path.write_text("from-file\nignored\n")
    Credentials.resolve(SecurityConfig(api_key_file=str(path))).check("Bearer from-file", False)
    monkeypatch.setenv("HOME", str(tmp_path))  # ~ expands, as the example configs write it
    Credentials.resolve(SecurityConfig(api_key_file="~/key")).check("Bearer from-file", False)
    path.write_text("\n")
    with pytest.raises(ConfigError, match="api-key-file.*empty"):
        Credentials.resolve(SecurityConfig(api_key_file=str(path)))
    with pytest.raises(ConfigError, match="admin-key-file.*cannot read"):
        Credentials.resolve(SecurityConfig(admin_key_file=str(tmp_path / "missing")))
    with pytest.raises(ConfigError, match="must differ"):
        Credentials.resolve(SecurityConfig(api_key="same", admin_key="same"))
    for fields, match in (
        ({"api_key": "k", "api_key_file": str(path)}, "api_key and api_key_file"),
        ({"tls_cert": "c.pem"}, "tls_cert and tls_key"),
        ({"tls_client_ca": "ca.pem"}, "tls_client_ca needs"),
    ):
        with pytest.raises(ConfigError, match=match):
            build_config(None, {"security": fields})


def test_print_config_never_shows_a_key():
    from pdserve.cluster.config import to_dict

    config = build_config(None, {"security": {"api_key": API_KEY, "admin_key": ADMIN_KEY}})
    text = repr(config) + repr(to_dict(config))
    assert API_KEY not in text and ADMIN_KEY not in text
    assert to_dict(config)["security"]["api_key"] == "<set>"


def test_listening_beyond_loopback_needs_a_key_or_insecure(monkeypatch):
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    monkeypatch.delenv("PDSERVE_ADMIN_KEY", raising=False)
    for host in ("127.0.0.1", "127.0.0.2", "localhost", "::1", "[::1]"):
        assert is_loopback(host), host
    for host in ("0.0.0.0", "::", "10.1.2.3", "myhost"):
        assert not is_loopback(host), host
    open_config = SecurityConfig()
    none = Credentials.resolve(open_config)
    check_exposure("127.0.0.1", none, open_config)  # loopback: no key needed
    admin_only = SecurityConfig(admin_key="b" * 20)  # generation would still be open
    for host, config in (("0.0.0.0", open_config), ("10.1.2.3", open_config), ("::", admin_only)):
        with pytest.raises(
            ConfigError, match=rf"--host {re.escape(host)}: .*--api-key.*--insecure"
        ):
            check_exposure(host, Credentials.resolve(config), config)
    with_key = SecurityConfig(api_key="a" * 20)
    check_exposure("0.0.0.0", Credentials.resolve(with_key), with_key)
    assert open_doors_warning("0.0.0.0", Credentials.resolve(with_key), with_key, ["x"]) is None
    insecure = SecurityConfig(insecure=True)
    check_exposure("0.0.0.0", none, insecure)
    warning = open_doors_warning("0.0.0.0", none, insecure, ["gRPC 0.0.0.0:1", "HTTP 0.0.0.0:2"])
    assert (
        warning.startswith("--insecure: open to anyone")
        and "gRPC 0.0.0.0:1; HTTP 0.0.0.0:2" in warning
    )
    assert open_doors_warning("127.0.0.1", none, insecure, ["gRPC 127.0.0.1:1"]) is None


def test_insecure_is_a_switch_of_serve(monkeypatch):
    from pdserve.cli.commands import config_from_args
    from pdserve.cli.main import _build_parser

    parser, _ = _build_parser()
    assert config_from_args(parser.parse_args(["serve", "--insecure"])).security.insecure
    assert not config_from_args(parser.parse_args(["serve"])).security.insecure
    args = parser.parse_args(["serve", "--security.insecure", "true", "--host", "0.0.0.0"])
    config = config_from_args(args)
    assert config.security.insecure and config.router.host == "0.0.0.0"


GRPC_CALLS = {
    "Generate": lambda c: list(c.generate(generate_request([0, 5, 6], max_tokens=2), 60)),
    "GetStatus": lambda c: c.status(),
    "ScalePool": lambda c: c.scale("decode", 1, 60),
    "DrainWorker": lambda c: c.drain("decode-99", 60),
}


def _code(call, c) -> grpc.StatusCode:
    try:
        call(c)
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def test_grpc_refuses_missing_and_wrong_keys_and_api_key_cannot_administer(server, certs):
    for key in (None, "wrong-key", ADMIN_KEY[:-1]):
        with client(server, certs, key) as c:
            assert c.is_serving(), "health stays open without a key"
            for name, call in GRPC_CALLS.items():
                assert _code(call, c) == grpc.StatusCode.UNAUTHENTICATED, (name, key)
    with client(server, certs, API_KEY) as c:
        assert _code(GRPC_CALLS["Generate"], c) == grpc.StatusCode.OK
        for name in ("GetStatus", "ScalePool", "DrainWorker"):
            assert _code(GRPC_CALLS[name], c) == grpc.StatusCode.PERMISSION_DENIED, name
    with client(server, certs, ADMIN_KEY) as c:
        assert _code(GRPC_CALLS["GetStatus"], c) == grpc.StatusCode.OK
        assert _code(GRPC_CALLS["DrainWorker"], c) == grpc.StatusCode.NOT_FOUND  # past the key
        assert _code(GRPC_CALLS["Generate"], c) == grpc.StatusCode.OK


def test_grpc_reflection_needs_the_key(server, certs):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    for key, expected in ((None, grpc.StatusCode.UNAUTHENTICATED), (API_KEY, grpc.StatusCode.OK)):
        with client(server, certs, key) as c:
            stub = reflection_pb2_grpc.ServerReflectionStub(c.channel)
            ask = reflection_pb2.ServerReflectionRequest(list_services="")
            try:
                list(stub.ServerReflectionInfo(iter([ask]), metadata=c.metadata, timeout=30))
                code = grpc.StatusCode.OK
            except grpc.RpcError as e:
                code = e.code()
            assert code == expected, key


HTTP_ENDPOINTS = (
    ("GET", "/v1/models", None),
    ("GET", "/version", None),
    ("GET", "/metrics", None),
    ("POST", "/v1/completions", {"prompt": [0, 5, 6], "max_tokens": 2}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
)


def test_http_refuses_missing_and_wrong_keys_on_every_endpoint_but_health(server, certs):
    base = server.http_url.removesuffix("/v1")
    with http(certs) as h:
        assert h.get(f"{base}/health").status_code == 200
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": API_KEY}):
            for method, path, body in HTTP_ENDPOINTS:
                r = h.request(method, base + path, json=body, headers=headers)
                assert r.status_code == 401, (path, headers)
                assert r.json()["error"]["type"] == "authentication_error"
                assert r.headers["www-authenticate"] == "Bearer"
        for key in (API_KEY, ADMIN_KEY):
            r = h.get(f"{base}/metrics", headers={"authorization": f"Bearer {key}"})
            assert r.status_code == 200 and "pdserve:" in r.text
    with pytest.raises(openai.AuthenticationError):
        api(server, certs, "wrong").models.list()
    reply = api(server, certs, API_KEY).completions.create(
        model=server.server.model.name, prompt=[0, 5, 6], max_tokens=3, temperature=0
    )
    assert reply.usage.completion_tokens == 3


# TLS.


def test_clients_without_a_certificate_the_ca_signed_cannot_connect(server, certs):
    with client(server, certs, API_KEY, cert=False) as c:
        assert _code(GRPC_CALLS["Generate"], c) == grpc.StatusCode.UNAVAILABLE
    with Client(server.address, key=API_KEY) as c:  # plaintext to a TLS port
        assert _code(GRPC_CALLS["Generate"], c) == grpc.StatusCode.UNAVAILABLE
    with http(certs, cert=False) as h, pytest.raises(httpx2.TransportError):
        h.get(server.http_url + "/models", headers={"authorization": f"Bearer {API_KEY}"})
    with pytest.raises(urllib.error.URLError):  # a client that does not trust our CA
        urllib.request.urlopen(server.http_url.removesuffix("/v1") + "/health", timeout=10)


# Exposure.


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads /proc/net/tcp")
def test_no_port_of_ours_listens_on_the_wildcard_address(server):
    import ray

    def _ray_process(_self=None) -> tuple[int, int]:
        """(pid, port of Ray's own core-worker server) of the process it runs in (a nested function:
        Ray ships it by value to the actors)."""
        import ray
        from ray.core.generated import common_pb2

        core_worker = ray._private.worker.global_worker.core_worker
        address = common_pb2.Address.FromString(core_worker.get_owner_address(ray.put(0)))
        return os.getpid(), address.port

    actors = [w.actor for w in server.server.router.workers.values()]
    processes = [_ray_process(), *ray.get([a.__ray_call__.remote(_ray_process) for a in actors])]
    sockets = listening()
    ours = {}
    for pid, ray_port in processes:
        for inode in sockets_of(pid) & sockets.keys():
            host, port = sockets[inode]
            if port != ray_port:  # Ray's own server: behind Ray's token authentication
                ours[port] = host
    s = server.server
    for port in (s.port, s.http_port, s._store.port):
        assert port in ours, f"port {port} not found listening in {ours}"
    wildcard = {"00000000", "00000000000000000000000000000000"}
    assert not {port: host for port, host in ours.items() if host in wildcard}, ours


def test_status_lists_what_is_exposed_and_what_each_needs(server, certs):
    with client(server, certs, ADMIN_KEY) as c:
        status = c.status()
    found = {e.name: e for e in status.endpoints}
    s = server.server
    assert set(found) == {"gRPC", "HTTP", "KV store", "Ray"}, found
    assert found["gRPC"].address == f"127.0.0.1:{s.port}"
    assert (found["gRPC"].auth, found["gRPC"].tls) == ("API key; Admin: admin key", "mutual TLS")
    assert found["HTTP"].address == f"127.0.0.1:{s.http_port}"
    assert (found["HTTP"].auth, found["HTTP"].tls) == ("API key", "mutual TLS")
    assert found["KV store"].address == f"{s._store_host}:{s._store.port}"
    assert found["KV store"].tls == "none" and found["KV store"].auth.startswith("none")
    assert found["Ray"].auth == "Ray token"
    text = format_status(status)
    assert f"127.0.0.1:{s.port}" in text and "API key; Admin: admin key" in text


def test_anonymous_store_client_finds_but_cannot_move_the_pairs_keys(server, certs, reference):
    s = server.server
    with client(server, certs, API_KEY) as c:
        first = [
            t
            for ch in c.generate(generate_request([0, 7, 8, 9], max_tokens=6, temperature=0))
            for t in ch.token_ids
        ]
    assert first == reference([0, 7, 8, 9], 6)
    anonymous = dist.TCPStore(
        s._store_host, s._store.port, is_master=False, timeout=datetime.timedelta(seconds=10)
    )
    pair = "pdkv/prefill-0/decode-0"
    keys = anonymous.list_keys()
    assert any(k.startswith(f"{pair}/") for k in keys), f"the pair never met: {keys}"
    secret = s.store_secret
    assert not any(secret in k or secret.encode() in anonymous.get(k) for k in keys)
    # The attack that failed every request for a minute: bump the epoch, claim both sides are ready. The
    # workers sign every value with a key the store never holds, so none of this moves the pair.
    for epoch in range(50):
        anonymous.set(f"{pair}/epoch", str(epoch + 1))
        anonymous.set(f"{pair}/{epoch}/ready0", "1")
        anonymous.set(f"{pair}/{epoch}/ready1", "1")
    with client(server, certs, API_KEY) as c:
        chunks = list(
            c.generate(generate_request([0, 7, 8, 9], max_tokens=6, temperature=0), timeout_s=20)
        )
    assert [t for ch in chunks for t in ch.token_ids] == first


# Bounded work per request.


def _stream_beside(c: Client, side_load) -> tuple[list[float], list[float]]:
    """Arrival times of a greedy stream's token chunks, with `side_load()` run in another thread from its
    4th chunk on, and [start, end] of the side load (its errors are raised here)."""
    request = generate_request([0, 11, 12, 13], max_tokens=64, temperature=0, ignore_eos=True)
    started, window, failed = threading.Event(), [], []

    def side() -> None:
        started.wait(60)
        window.append(time.perf_counter())
        try:
            side_load()
        except BaseException as e:  # raised by the test's thread
            failed.append(e)
        window.append(time.perf_counter())

    thread = threading.Thread(target=side)
    thread.start()
    times = []
    for chunk in c.generate(request, timeout_s=120):
        if chunk.token_ids:
            times.append(time.perf_counter())
        if len(times) == 4:
            started.set()
    started.set()
    thread.join(60)
    if failed:
        raise failed[0]
    assert len(window) == 2 and window[0] < times[-1], "the stream ended before the side load began"
    return times, window


ATTACK_TRIES = 3


def _largest_gap(times: list[float], window: list[float]) -> float:
    """The longest wait between chunks that overlaps `window`."""
    start, end = window
    return max(b - a for a, b in zip(times, times[1:], strict=False) if b >= start and a <= end)


def test_huge_prompt_and_largest_stop_lists_do_not_delay_other_streams(server, certs, reference):
    """Measured against the same stream beside a plain request of the same length: what the attack adds.
    The attacker sends bytes serialized beforehand, on connections of its own (this process also hosts the
    server and the stream's client: serializing 4 MiB here would hold their GIL)."""
    # As many stop ids as allowed that the stop request's own greedy output leaves alone (the tiny model's
    # vocabulary is about MAX_STOP_TOKEN_IDS ids), so that it runs to max_tokens checking them all.
    output = set(reference([0, 21, 22], 24))
    stop_ids = [i for i in range(server.server.model.vocab_size) if i not in output]
    plain = generate_request([0, 21, 22], max_tokens=24, temperature=0, ignore_eos=True)
    stops = generate_request(
        [0, 21, 22], max_tokens=24, temperature=0, ignore_eos=True,
        stop_token_ids=stop_ids[:MAX_STOP_TOKEN_IDS],
        stop=[f"{i:03d}" + "\u00a7" * (MAX_STOP_STRING_CHARS - 3) for i in range(MAX_STOP_STRINGS)],
    )  # fmt: skip
    huge = "hello world " * ((4 << 20) // 12)  # 4 MiB of text
    huge_message = generate_request(huge, max_tokens=4).SerializeToString()
    huge_body = json.dumps({"prompt": huge, "max_tokens": 4}).encode()
    url = server.http_url + "/completions"
    headers = {"authorization": f"Bearer {API_KEY}", "content-type": "application/json"}
    with client(server, certs, API_KEY) as c, client(server, certs, API_KEY) as a, http(certs) as h:
        raw_generate = a.channel.unary_stream(
            "/pdserve.v1.Generation/Generate",
            response_deserializer=generation_pb2.GenerateResponse.FromString,
        )

        def run(request) -> None:
            assert sum(len(ch.token_ids) for ch in a.generate(request, timeout_s=60)) == 24

        def attack() -> None:
            with pytest.raises(grpc.RpcError) as refused:
                list(raw_generate(huge_message, metadata=a.metadata, timeout=60))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "fits the context" in refused.value.details()
            try:
                r = h.post(url, content=huge_body, headers=headers)
                assert r.status_code == 413 and r.json()["error"]["param"] == "body", r.text
            except httpx2.TransportError:  # refused (and closed) before all of it was sent
                pass
            run(stops)

        # On a loaded machine one gap can stretch for reasons of its own: a stall the attack causes shows in
        # every try, so the attack passes when one try stays within the bound.
        tries = []
        for _ in range(ATTACK_TRIES):
            before = _largest_gap(*_stream_beside(c, lambda: run(plain)))
            during = _largest_gap(*_stream_beside(c, attack))
            tries.append(
                f"{1e3 * during:.0f} ms under attack, {1e3 * before:.0f} ms beside a plain one"
            )
            if during <= before + 0.05:
                break
        else:
            raise AssertionError(f"largest gap of the stream in each try: {'; '.join(tries)}")


def test_text_that_cannot_fit_the_context_is_refused_before_tokenizing(model_dir):
    from pdserve.cluster.config import RouterConfig
    from pdserve.frontend.validation import ModelInfo, check_prompt_bytes, text_bytes_bound
    from pdserve.model.errors import InvalidRequestError

    model = ModelInfo.load(model_dir, "tiny")
    spec = json.loads((model_dir / "tokenizer.json").read_text())
    longest = max(
        len(t.encode())
        for t in [*spec["model"]["vocab"], *(a["content"] for a in spec["added_tokens"])]
    )
    assert model.max_text_bytes == model.max_model_len * longest
    # Text at the bound may still fit (every token as long as the longest); a byte more cannot.
    router = RouterConfig()
    check_prompt_bytes("a" * model.max_text_bytes, router, "prompt", model)
    with pytest.raises(InvalidRequestError, match="cannot fit the context of") as e:
        check_prompt_bytes("a" * (model.max_text_bytes + 1), router, "prompt", model)
    assert e.value.field == "prompt"
    with pytest.raises(InvalidRequestError, match=r"router.max_prompt_bytes"):
        check_prompt_bytes("\u00e9" * 600, RouterConfig(max_prompt_bytes=1000), "prompt", model)
    # Tokenizers whose tokens may swallow unbounded input get no bound.
    for change in (
        {"normalizer": {"type": "NFKC"}},
        {"pre_tokenizer": {"type": "Whitespace"}},
        {"added_tokens": [{"content": "<x>", "lstrip": True}]},
    ):
        assert text_bytes_bound({**spec, **change}, 4096) is None, change


def test_grpc_messages_over_the_limit_are_refused_unparsed_naming_it():
    from pdserve.cluster.config import RouterConfig
    from pdserve.frontend.grpc_service import _lenient, _Undecodable, message_limit

    limit = message_limit(RouterConfig(max_message_bytes=1000))
    assert limit == (1000, "router.max_message_bytes")
    parse = _lenient(generation_pb2.GenerateRequest.FromString, "GenerateRequest", limit)
    small = generate_request("x" * 900).SerializeToString()
    assert parse(small).prompt == "x" * 900
    refused = parse(generate_request("x" * 1000).SerializeToString())
    assert isinstance(refused, _Undecodable)
    assert "reads at most 1000 (router.max_message_bytes)" in refused.message
    assert message_limit(RouterConfig(max_prompt_bytes=5000))[0] == 5000 + (1 << 20)


def test_cli_client_commands_take_keys_and_tls_from_flags_and_environment(
    server, certs, monkeypatch, capsys
):
    from pdserve.cli.main import main

    tls = ["--addr", server.address, "--tls-ca", certs["ca.pem"], "--tls-cert", certs["client.pem"]]
    tls += ["--tls-key", certs["client.key"]]
    monkeypatch.delenv("PDSERVE_ADMIN_KEY", raising=False)
    monkeypatch.setenv("PDSERVE_API_KEY", API_KEY)
    assert main(["generate", "--prompt-ids", "0,5,6", "--max-tokens", "2", "--json", *tls]) == 0
    assert main(["status", *tls]) == 1  # the API key cannot read status
    assert "PERMISSION_DENIED" in capsys.readouterr().err
    monkeypatch.setenv("PDSERVE_ADMIN_KEY", ADMIN_KEY)
    assert main(["status", "--json", *tls]) == 0
    assert '"pools"' in capsys.readouterr().out
    monkeypatch.delenv("PDSERVE_API_KEY")
    monkeypatch.delenv("PDSERVE_ADMIN_KEY")
    assert main(["status", *tls]) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    assert main(["status", "--admin-key", ADMIN_KEY, *tls]) == 0
