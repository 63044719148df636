//! One Connect unary call `POST {url}/push.v1.PusherService/Push` with a protobuf body, and the
//! retry decision for its result (docs/pyroscope.md §1.3, §1.4).
use std::time::Duration;

use base64::Engine;

use super::{PushAuth, PushConfig, PushError};

/// Per-request time limit (as Grafana Alloy uses).
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
const PUSH_PATH: &str = "/push.v1.PusherService/Push";
/// How much of an error response is read for the log line.
const ERROR_BODY_LIMIT: u64 = 4096;

/// What became of one request.
#[derive(Debug, PartialEq, Eq)]
pub enum Outcome {
    Sent,
    /// Worth retrying: network errors, timeouts, 408, 429 and 5xx.
    Retry {
        reason: String,
        retry_after: Option<Duration>,
    },
    /// The receiver refused the request itself (other 4xx); retrying cannot help.
    Rejected {
        status: u16,
        message: String,
    },
}

/// Whether a non-success HTTP status is worth retrying.
pub fn is_retryable_status(status: u16) -> bool {
    status == 408 || status == 429 || (500..600).contains(&status)
}

/// Checks that `url` is an absolute http(s) URL with a host; returns it without a trailing `/`.
pub fn validate_url(url: &str) -> Result<String, String> {
    let trimmed = url.trim().trim_end_matches('/');
    let uri: ureq::http::Uri = trimmed
        .parse()
        .map_err(|e| format!("'{url}' is not a URL: {e}"))?;
    match uri.scheme_str() {
        Some("http" | "https") => {}
        _ => return Err(format!("'{url}' must start with http:// or https://")),
    }
    if uri.host().is_none_or(str::is_empty) {
        return Err(format!("'{url}' has no host"));
    }
    if uri.query().is_some() {
        return Err(format!("'{url}' must not have a query string"));
    }
    Ok(trimmed.to_owned())
}

pub struct Client {
    agent: ureq::Agent,
    endpoint: String,
    /// Authorization and tenant headers, fixed for the agent's lifetime.
    headers: Vec<(&'static str, String)>,
}

impl Client {
    pub fn new(config: &PushConfig) -> Result<Client, PushError> {
        let base = validate_url(&config.url).map_err(PushError::InvalidUrl)?;
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .timeout_global(Some(REQUEST_TIMEOUT))
            .http_status_as_error(false)
            .user_agent(concat!("profiler/", env!("CARGO_PKG_VERSION")))
            .build()
            .into();
        let mut headers = Vec::new();
        match &config.auth {
            PushAuth::None => {}
            PushAuth::Basic { user, password } => {
                let credentials =
                    base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
                headers.push(("Authorization", format!("Basic {credentials}")));
            }
            PushAuth::Bearer(token) => headers.push(("Authorization", format!("Bearer {token}"))),
        }
        if let Some(tenant) = &config.tenant_id {
            headers.push(("X-Scope-OrgID", tenant.clone()));
        }
        Ok(Client {
            agent,
            endpoint: format!("{base}{PUSH_PATH}"),
            headers,
        })
    }

    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Sends one encoded `PushRequest`.
    pub fn send(&self, body: &[u8]) -> Outcome {
        let mut request = self
            .agent
            .post(&self.endpoint)
            .header("Content-Type", "application/proto")
            .header("Connect-Protocol-Version", "1")
            .header(
                "Connect-Timeout-Ms",
                REQUEST_TIMEOUT.as_millis().to_string(),
            );
        for (name, value) in &self.headers {
            request = request.header(*name, value);
        }
        let mut response = match request.send(body) {
            Ok(response) => response,
            Err(err) => {
                return Outcome::Retry {
                    reason: err.to_string(),
                    retry_after: None,
                };
            }
        };
        let status = response.status().as_u16();
        let retry_after = response
            .headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map(Duration::from_secs);
        // Read the body so the connection can be reused, and for the error message.
        let text = response
            .body_mut()
            .with_config()
            .limit(ERROR_BODY_LIMIT)
            .read_to_string()
            .unwrap_or_default();
        if (200..300).contains(&status) {
            return Outcome::Sent;
        }
        let message = error_message(&text);
        if is_retryable_status(status) {
            Outcome::Retry {
                reason: format!("HTTP {status}: {message}"),
                retry_after,
            }
        } else {
            Outcome::Rejected { status, message }
        }
    }
}

/// The `message` of a Connect error body, else the body's first line, shortened for a log line.
fn error_message(body: &str) -> String {
    let message = serde_json::from_str::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v.get("message").and_then(|m| m.as_str()).map(str::to_owned))
        .unwrap_or_else(|| body.lines().next().unwrap_or("").to_owned());
    let message = message.trim();
    if message.is_empty() {
        return "(no message)".into();
    }
    match message.char_indices().nth(200) {
        Some((cut, _)) => format!("{}…", &message[..cut]),
        None => message.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retries_only_what_can_succeed_later() {
        for status in [408, 429, 500, 502, 503, 504] {
            assert!(is_retryable_status(status), "{status}");
        }
        for status in [400, 401, 403, 404, 409, 413, 415, 422] {
            assert!(!is_retryable_status(status), "{status}");
        }
    }

    #[test]
    fn urls_are_checked() {
        assert_eq!(
            validate_url("http://127.0.0.1:4040/").unwrap(),
            "http://127.0.0.1:4040"
        );
        assert_eq!(
            validate_url("https://profiles-prod.grafana.net/prefix").unwrap(),
            "https://profiles-prod.grafana.net/prefix"
        );
        assert!(
            validate_url("127.0.0.1:4040")
                .unwrap_err()
                .contains("http://")
        );
        assert!(validate_url("ftp://host").unwrap_err().contains("http://"));
        assert!(validate_url("http://").is_err());
        assert!(validate_url("http://h/?a=1").unwrap_err().contains("query"));
        assert!(validate_url("not a url").is_err());
    }

    #[test]
    fn error_messages_come_from_connect_errors_and_stay_short() {
        assert_eq!(
            error_message(r#"{"code":"invalid_argument","message":"bad labels"}"#),
            "bad labels"
        );
        assert_eq!(error_message("plain text\nmore"), "plain text");
        assert_eq!(error_message(""), "(no message)");
        assert_eq!(error_message(&"x".repeat(500)).chars().count(), 201);
    }

    #[test]
    fn network_errors_are_retried() {
        // A port nobody listens on: bind, note the port, close.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let client = Client::new(&PushConfig::new(format!("http://127.0.0.1:{port}"))).unwrap();
        assert!(matches!(client.send(b""), Outcome::Retry { .. }));
    }
}
