//! The API's OpenAPI document, from a real server on a loopback socket: it describes every endpoint of the router
//! with the content types they really send, and errors carry their stable codes.
//! Without Python or PyPI the test fails saying so: it is never skipped.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{Value, json};

fn tmpdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("shoal-openapi-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("temp dir");
    d
}

/// A real server on a free loopback port, in its own runtime, whose tasks run `/bin/false`: nothing a request
/// submits can start real work.
struct Live {
    rt: tokio::runtime::Runtime,
    server: Option<shoal_control::Server>,
    dir: PathBuf,
    base: String,
    admin: String,
    agent: ureq::Agent,
}

impl Live {
    fn start(tag: &str) -> Live {
        let dir = tmpdir(tag);
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("a tokio runtime");
        let mut opts = shoal_control::ServerOptions::new(
            &dir.join("data"),
            "127.0.0.1:0".parse().expect("addr"),
            Path::new("/bin/false"),
        );
        opts.cpus_milli = Some(2000);
        opts.memory_bytes = Some(4 << 30);
        opts.tick = Duration::from_millis(100);
        opts.kill_grace = Duration::from_millis(200);
        let server = rt.block_on(shoal_control::start(opts)).expect("start the server");
        let base = format!("http://{}", server.addr);
        let admin = server.admin_token.clone();
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(30)))
            .build()
            .into();
        Live { rt, server: Some(server), dir, base, admin, agent }
    }

    /// A request as `token`; the status and the body as JSON (a JSON string when it is not JSON).
    fn call(&self, method: &str, path: &str, token: Option<&str>, body: Option<&Value>) -> (u16, Value) {
        let url = format!("{}{path}", self.base);
        let auth = token.map(|t| format!("Bearer {t}"));
        let resp = match (method, body) {
            ("GET", _) => {
                let mut r = self.agent.get(&url);
                if let Some(a) = &auth {
                    r = r.header("Authorization", a);
                }
                r.call()
            }
            (_, b) => {
                let mut r = self.agent.post(&url).header("Content-Type", "application/json");
                if let Some(a) = &auth {
                    r = r.header("Authorization", a);
                }
                r.send(b.map_or_else(String::new, Value::to_string))
            }
        };
        let mut resp = resp.unwrap_or_else(|e| panic!("{method} {path}: {e}"));
        let status = resp.status().as_u16();
        let text = resp.body_mut().read_to_string().unwrap_or_else(|e| panic!("{method} {path}: body: {e}"));
        (status, serde_json::from_str(&text).unwrap_or(Value::String(text)))
    }

    fn document(&self) -> Value {
        let (st, doc) = self.call("GET", "/api/v1/openapi.json", None, None);
        assert_eq!(st, 200, "GET /api/v1/openapi.json without a token: {doc}");
        assert!(doc.is_object(), "the document is not a JSON object: {doc}");
        doc
    }
}

impl Drop for Live {
    fn drop(&mut self) {
        if let Some(s) = self.server.take() {
            self.rt.block_on(s.shutdown());
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[test]
fn the_openapi_document_describes_every_endpoint_of_the_router() {
    let live = Live::start("doc");
    let doc = live.document();
    assert!(doc["openapi"].as_str().is_some_and(|v| v.starts_with("3.")), "not OpenAPI 3: {}", doc["openapi"]);
    let paths = doc["paths"].as_object().unwrap_or_else(|| panic!("no paths: {doc:#}"));

    // Every route of the router is described, and nothing else is.
    let routes = shoal_control::api::endpoints();
    let mut missing = Vec::new();
    for (method, path) in &routes {
        let op = &doc["paths"][*path][method.as_str().to_ascii_lowercase()];
        if !op.is_object() || !op["responses"].is_object() {
            missing.push(format!("{method} {path}"));
        }
    }
    assert!(missing.is_empty(), "routes the OpenAPI document does not describe: {missing:?}");
    for (path, ops) in paths {
        for method in ops.as_object().into_iter().flat_map(|o| o.keys()) {
            let known = routes.iter().any(|(m, p)| p == path && m.as_str().eq_ignore_ascii_case(method));
            assert!(known, "the document describes {method} {path}, which the router does not serve");
        }
    }

    // Bearer tokens everywhere but the health check and the document itself.
    assert_eq!(doc["components"]["securitySchemes"]["bearer"]["scheme"], "bearer", "{:#}", doc["components"]);
    assert_eq!(doc["security"], json!([{ "bearer": [] }]), "a global bearer requirement");
    for open in ["/healthz", "/api/v1/openapi.json"] {
        assert_eq!(doc["paths"][open]["get"]["security"], json!([{}]), "{open} needs no token");
    }

    // The content types they really send.
    let content = |path: &str, status: &str| -> Vec<String> {
        doc["paths"][path]["get"]["responses"][status]["content"]
            .as_object()
            .map(|c| c.keys().cloned().collect())
            .unwrap_or_default()
    };
    assert_eq!(content("/api/v1/jobs/{id}/logs", "200"), ["text/plain"]);
    assert_eq!(content("/api/v1/jobs/{id}/stream", "200"), ["text/event-stream"]);
    assert_eq!(content("/api/v1/overview/stream", "200"), ["text/event-stream"]);
    assert_eq!(content("/metrics", "200"), ["text/plain; version=0.0.4"]);
    assert_eq!(content("/api/v1/jobs/{id}", "200"), ["application/json"]);
    assert_eq!(content("/api/v1/jobs/{id}", "404"), ["application/json"]);
    let submit = &doc["paths"]["/api/v1/jobs"]["post"]["requestBody"]["content"];
    assert!(submit["application/json"].is_object() && submit["application/toml"].is_object(), "{submit:#}");

    // The error body and its codes, in the document and on the wire.
    let codes = &doc["components"]["schemas"]["ErrorCode"]["enum"];
    for code in shoal_wire::ErrorCode::ALL {
        assert!(
            codes.as_array().is_some_and(|a| a.iter().any(|c| c == code.as_str())),
            "{code} not in the ErrorCode schema: {codes}"
        );
    }
    let (st, v) = live.call("GET", "/api/v1/jobs", None, None);
    assert_eq!((st, v["code"].as_str(), v["status"].as_u64()), (401, Some("unauthorized"), Some(401)), "{v}");
    let bad_steps = json!({ "name": "x", "train": { "model": "mlp", "dataset": "digits", "steps": "many" } });
    let (st, v) = live.call("POST", "/api/v1/jobs", Some(&live.admin), Some(&bad_steps));
    assert_eq!((st, v["code"].as_str(), v["field"].as_str()), (400, Some("invalid_spec"), Some("train.steps")), "{v}");
    let (st, v) = live.call("GET", "/api/v1/jobs?state=bogus", Some(&live.admin), None);
    assert_eq!((st, v["code"].as_str(), v["field"].as_str()), (400, Some("bad_request"), Some("state")), "{v}");
    let (st, v) = live.call("POST", "/api/v1/whoami", Some(&live.admin), Some(&json!({})));
    assert_eq!((st, v["code"].as_str()), (405, Some("method_not_allowed")), "{v}");
    let (st, v) = live.call("GET", "/api/v1/jobs/j-00000000", Some(&live.admin), None);
    assert_eq!((st, v["code"].as_str()), (404, Some("not_found")), "{v}");
}
