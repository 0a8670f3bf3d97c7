"""The server's CORS, HTTPS and root path (vLLM's `--allowed-origins` ..., `--ssl-keyfile` / `--ssl-certfile`,
`--root-path`), over the fake engine; vLLM's other launch flags parsed."""

from __future__ import annotations

import dataclasses
import shutil
import ssl
import subprocess

import httpx
import pytest

from server.cli import add_serve_args, server_config_from_args
from server.config import ServerConfig
from server.fake_engine import FakeAsyncEngine
from server.runner import serve_in_thread

PREFLIGHT = {"Origin": "http://ui.example", "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}
BODY = {"model": "fake-model", "prompt": "hello", "max_tokens": 2}


@pytest.fixture(scope="module")
def engine():
    eng = FakeAsyncEngine(step_delay=0.001)
    yield eng
    eng.shutdown()


def test_browsers_may_call_from_any_origin_by_default(engine):
    with serve_in_thread(engine, ServerConfig(port=0, api_key="k", served_model_names=("fake-model",))) as srv:
        pre = httpx.options(srv.url + "/v1/completions", headers=PREFLIGHT)
        assert pre.status_code == 200  # answered before the API key is asked for
        assert pre.headers["access-control-allow-origin"] == "*"
        assert "POST" in pre.headers["access-control-allow-methods"]
        got = httpx.post(srv.url + "/v1/completions", json=BODY,
                         headers={"Origin": "http://ui.example", "Authorization": "Bearer k"})
        assert got.status_code == 200 and got.headers["access-control-allow-origin"] == "*"
        refused = httpx.post(srv.url + "/v1/completions", json=BODY, headers={"Origin": "http://ui.example"})
        assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == "*"


def test_origins_limited_as_configured(engine):
    config = ServerConfig(port=0, allowed_origins=("http://ui.example",), allow_credentials=True,
                          allowed_methods=("GET", "POST"), served_model_names=("fake-model",))
    with serve_in_thread(engine, config) as srv:
        pre = httpx.options(srv.url + "/v1/completions", headers=PREFLIGHT)
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "http://ui.example"
        assert pre.headers["access-control-allow-credentials"] == "true"
        other = httpx.options(srv.url + "/v1/completions", headers={**PREFLIGHT, "Origin": "http://evil.example"})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
        put = httpx.options(srv.url + "/v1/completions", headers={**PREFLIGHT, "Access-Control-Request-Method": "PUT"})
        assert put.status_code == 400


def test_a_proxys_root_path(engine):
    with serve_in_thread(engine, ServerConfig(port=0, api_key="k", root_path="/llm",
                                              served_model_names=("fake-model",))) as srv:
        auth = {"Authorization": "Bearer k"}
        assert httpx.get(srv.url + "/llm/v1/models", headers=auth).json()["data"][0]["id"] == "fake-model"
        assert httpx.get(srv.url + "/v1/models", headers=auth).status_code == 200  # (a proxy that strips it)
        assert httpx.get(srv.url + "/llm/health").status_code == 200  # open, as without the prefix


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_https_with_the_given_certificate(engine, tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    config = ServerConfig(port=0, ssl_keyfile=str(key), ssl_certfile=str(cert), served_model_names=("fake-model",))
    with serve_in_thread(engine, config) as srv:
        assert srv.url.startswith("https://127.0.0.1:")
        context = ssl.create_default_context(cafile=str(cert))
        got = httpx.post(srv.url + "/v1/completions", json=BODY, verify=context)
        assert got.status_code == 200 and got.json()["choices"][0]["text"]
        with pytest.raises(httpx.ConnectError):  # a client that does not trust the certificate
            httpx.get(srv.url + "/health")
        with pytest.raises(httpx.HTTPError):  # plain HTTP to the HTTPS port
            httpx.get(srv.url.replace("https", "http") + "/health")


def test_the_flags_and_their_checks(tmp_path):
    import argparse

    parser = add_serve_args(argparse.ArgumentParser())
    ns = parser.parse_args(["--allowed-origins", '["http://a.example"]', "--allow-credentials", "--root-path", "/llm"])
    config = server_config_from_args(ns)
    assert config.allowed_origins == ("http://a.example",) and config.allow_credentials
    assert config.allowed_methods == ("*",) and config.root_path == "/llm"
    with pytest.raises(SystemExit):
        parser.parse_args(["--allowed-origins", "http://a.example"])  # not a JSON list
    with pytest.raises(ValueError, match="HTTPS needs both ssl_keyfile and ssl_certfile"):
        ServerConfig(ssl_keyfile=str(tmp_path / "k"))
    with pytest.raises(ValueError, match="ssl_keyfile .* is not a file"):
        ServerConfig(ssl_keyfile=str(tmp_path / "k"), ssl_certfile=str(tmp_path / "c"))
    with pytest.raises(ValueError, match="root_path must start with '/'"):
        ServerConfig(root_path="llm/")


def test_vllm_launch_flags_are_taken():
    """Flags of vLLM launch commands: the server defaults (chat template kwargs, token ids) set the config; the
    compatibility flags parse and change nothing, and turning chunked prefill off is refused, named."""
    import argparse

    from jaxserve.engine_args import EngineArgs

    parser = add_serve_args(argparse.ArgumentParser())
    ns = parser.parse_args(["--default-chat-template-kwargs", '{"enable_thinking": false}', "--trust-remote-code",
                            "--return-tokens-as-token-ids", "--enable-chunked-prefill", "--enable-prompt-tokens-details",
                            "--enforce-eager"])
    config = server_config_from_args(ns)
    assert config.default_chat_template_kwargs == {"enable_thinking": False} and config.return_tokens_as_token_ids
    args = EngineArgs.from_cli_args(ns)
    assert args.trust_remote_code and args.enable_chunked_prefill and args.enforce_eager
    assert dataclasses.replace(args, trust_remote_code=False, enable_chunked_prefill=None,
                               enforce_eager=False) == EngineArgs()
    with pytest.raises(ValueError, match="default_chat_template_kwargs must be a JSON object"):
        server_config_from_args(parser.parse_args(["--default-chat-template-kwargs", "[1]"]))
    assert EngineArgs.from_cli_args(parser.parse_args(["-tp", "2", "--enable-expert-parallel"])).enable_expert_parallel
    with pytest.raises(ValueError, match="expert_parallel_size adds devices of its own: give one of them"):
        EngineArgs(enable_expert_parallel=True, expert_parallel_size=2)
    with pytest.raises(ValueError, match="enable_chunked_prefill false is not supported"):
        EngineArgs.from_cli_args(parser.parse_args(["--no-enable-chunked-prefill"]))
    # vLLM's parser takes flags with underscores; so does `jaxserve` (values are left alone).
    from jaxserve.cli import dashed_flags

    assert dashed_flags(["--max_model_len=64", "--chat_template", "{{ a_b }}", "-tp", "x_y"]) == [
        "--max-model-len=64", "--chat-template", "{{ a_b }}", "-tp", "x_y"]


def test_requests_and_outputs_logged_when_asked(engine, caplog):
    """`--enable-log-requests` / `--enable-log-outputs` (vLLM's): each engine request's prompt, token ids and
    parameters as it is submitted, its outputs as it finishes, cut to `--max-log-len`; by default (and with
    `--disable-log-requests`) neither."""
    import logging

    parser = add_serve_args(__import__("argparse").ArgumentParser())
    flags = ["--enable-log-requests", "--enable-log-outputs", "--max-log-len", "3"]
    config = dataclasses.replace(server_config_from_args(parser.parse_args(flags)), port=0,
                                 served_model_names=("fake-model",))
    assert not server_config_from_args(parser.parse_args(["--disable-log-requests"])).enable_log_requests
    with caplog.at_level(logging.INFO, logger="jaxserve.server.requests"):
        with serve_in_thread(engine, config) as srv:
            got = httpx.post(srv.url + "/v1/completions", json={**BODY, "prompt": "hello there", "n": 2},
                             headers={"X-Request-Id": "logme"})
        assert got.status_code == 200
        lines = [r.getMessage() for r in caplog.records if r.name == "jaxserve.server.requests"]
        received = [line for line in lines if line.startswith("Received request")]
        assert len(received) == 1 and "logme" in received[0] and "prompt: 'hel'," in received[0]
        assert "max_tokens=2" in received[0] and "lora_request: None" in received[0]
        generated = [line for line in lines if line.startswith("Generated response")]
        text = [c["text"] for c in got.json()["choices"]]
        assert len(generated) == 2 and all(f"output: {t[:3]!r}," in g for t, g in zip(text, generated, strict=True))
        caplog.clear()
        with serve_in_thread(engine, dataclasses.replace(config, enable_log_requests=False,
                                                         enable_log_outputs=False)) as srv:
            assert httpx.post(srv.url + "/v1/completions", json=BODY).status_code == 200
        assert not [r for r in caplog.records if r.name == "jaxserve.server.requests"]
