"""The published API schema, checked against the server by schemathesis: for every endpoint, requests generated
from /openapi.json (property-based, fixed derandomized seed) must never get a 5xx, and every answer must conform to
the schema (status codes, content types, response bodies and headers).

The app runs in-process over ASGI with a real engine on a tiny chat model, its context cut to 48 tokens so that
generated requests (any max_tokens, n up to 64) stay cheap. The engine must end idle with its KV pool free.
"""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.specs.openapi.checks import positive_data_acceptance
from starlette.testclient import TestClient

from conftest import assert_engine_clean
from helpers.server_fixtures import add_chat_template
from hyperdraft.config import EngineArgs
from hyperdraft.engine.engine import Engine
from hyperdraft.server.app import create_app
from hyperdraft.server.engine_loop import EngineLoop
from hyperdraft.server.generation import ServerContext
from hyperdraft.server.metrics import ServerMetrics
from hyperdraft.server.options import ServeOptions, served_model_name
from hyperdraft.server.preprocess import Preprocessor

EXAMPLES_PER_ENDPOINT = 40
# Every role the schema allows renders (the shared test template refuses some, which would hide the 200 path).
PERMISSIVE_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                       "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def app_and_engine(llama_path, tmp_path_factory):
    model = add_chat_template(shutil.copytree(llama_path, str(tmp_path_factory.mktemp("openapi") / "chat")),
                              PERMISSIVE_TEMPLATE)
    args = EngineArgs(model_path=model, device="cpu", dtype="float32", context_length=48, max_running_requests=16)
    opts = ServeOptions()
    engine = Engine(args)
    preprocessor = Preprocessor(engine.tokenizer, opts.limits(engine.context_len), engine.context_len,
                                engine.model_config.vocab_size)
    ctx = ServerContext(EngineLoop(engine), engine.tokenizer, preprocessor, ServerMetrics(),
                        served_model_name(args, opts), engine.context_len, False)
    app = create_app(ctx, opts)
    # schemathesis starts the app's lifespan (the engine thread) on its first call and keeps it for the process
    yield app, engine
    assert_engine_clean(SimpleNamespace(engine=engine))


@pytest.fixture(scope="module")
def api_schema(app_and_engine):
    return schemathesis.openapi.from_asgi("/openapi.json", app_and_engine[0])


def test_every_answer_conforms_and_none_is_a_5xx(api_schema):
    # (Hypothesis driven directly: schemathesis's pytest plugin does not support pytest 9's nodes.)
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert {f"{op.method.upper()} {op.path}" for op in operations} >= {
        "POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models", "GET /health", "GET /metrics"}
    for operation in operations:
        @given(case=operation.as_strategy())
        @settings(max_examples=EXAMPLES_PER_ENDPOINT, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def conforms(case):
            # Schema-valid requests may still be refused with a documented 400 (a token id past the vocabulary,
            # an unsupported option, a prompt over the context): positive data acceptance does not hold by design.
            case.call_and_validate(excluded_checks=[positive_data_acceptance])

        conforms()


def test_openapi_and_docs_are_served(app_and_engine):
    client = TestClient(app_and_engine[0])  # no `with`: the lifespan is schemathesis's (see the fixture)
    spec = client.get("/openapi.json").json()
    assert client.get("/docs").status_code == 200
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/server_info", "/metrics"):
        assert path in spec["paths"], path
    body = spec["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/CompletionRequest"}
    props = spec["components"]["schemas"]["CompletionRequest"]["properties"]
    assert {"prompt", "max_tokens", "temperature", "n", "seed", "stream"} <= set(props)
