//! One Connect unary call `POST {url}/push.v1.PusherService/Push` with a protobuf body, and the
//! retry decision for its result (docs/pyroscope-protocol.md §3.1, §3.6, §3.7).
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

/// `url` with the password of its userinfo (`http://user:pass@host`, which is sent as Basic
/// auth) replaced by `***`, for logs and error messages. A userinfo without a `:` may be a
/// token by itself and is replaced whole.
pub fn redact_url(url: &str) -> String {
    let Some(scheme_end) = url.find("://").map(|at| at + 3) else {
        // Not a URL; a userinfo may still be there (`user:pass@host`).
        return match url.rfind('@') {
            Some(at) => format!("***{}", &url[at..]),
            None => url.to_owned(),
        };
    };
    let rest = &url[scheme_end..];
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let authority = &rest[..authority_end];
    let Some(at) = authority.rfind('@') else {
        return url.to_owned();
    };
    let userinfo = match authority[..at].split_once(':') {
        Some((user, _password)) => format!("{user}:***"),
        None => "***".to_owned(),
    };
    format!(
        "{}{userinfo}{}{}",
        &url[..scheme_end],
        &authority[at..],
        &rest[authority_end..]
    )
}

/// The secret parts of a URL's userinfo (the password, or a userinfo without `:`), raw and
/// percent-decoded, so they can be scrubbed from error texts.
fn url_secrets(url: &str) -> Vec<String> {
    let Some(rest) = url.split_once("://").map(|(_, rest)| rest) else {
        return Vec::new();
    };
    let authority = &rest[..rest.find(['/', '?', '#']).unwrap_or(rest.len())];
    let Some((userinfo, _host)) = authority.rsplit_once('@') else {
        return Vec::new();
    };
    let secret = userinfo
        .split_once(':')
        .map_or(userinfo, |(_, password)| password);
    if secret.is_empty() {
        return Vec::new();
    }
    let mut secrets = vec![secret.to_owned()];
    let decoded = crate::process::labels::percent_decode(secret);
    if decoded != secret {
        secrets.push(decoded);
    }
    secrets
}

/// Checks that `url` is an absolute http(s) URL with a host; returns it without a trailing `/`.
/// Error messages show the URL redacted ([`redact_url`]).
pub fn validate_url(url: &str) -> Result<String, String> {
    let trimmed = url.trim().trim_end_matches('/');
    let uri: ureq::http::Uri = trimmed.parse().map_err(|e: ureq::http::uri::InvalidUri| {
        let shown = redact_url(url);
        // The parser's message may quote the input: keep only what names no secret.
        let reason = scrub(&e.to_string(), &url_secrets(url));
        format!("'{shown}' is not a URL: {reason}")
    })?;
    let url = redact_url(url);
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

/// `text` with every secret replaced by `***`.
fn scrub(text: &str, secrets: &[String]) -> String {
    secrets.iter().fold(text.to_owned(), |text, secret| {
        text.replace(secret.as_str(), "***")
    })
}

pub struct Client {
    agent: ureq::Agent,
    /// Where requests go, credentials included.
    request_url: String,
    /// The endpoint for logs: without the URL's password.
    shown_endpoint: String,
    /// The URL's password, scrubbed from error texts.
    secrets: Vec<String>,
    /// Authorization and tenant headers, fixed for the agent's lifetime.
    headers: Vec<(&'static str, String)>,
}

impl Client {
    pub fn new(config: &PushConfig) -> Result<Client, PushError> {
        let base = validate_url(config.url.expose()).map_err(PushError::InvalidUrl)?;
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
            shown_endpoint: redact_url(&format!("{base}{PUSH_PATH}")),
            secrets: url_secrets(&base),
            request_url: format!("{base}{PUSH_PATH}"),
            headers,
        })
    }

    /// The endpoint as logs may show it: any password in the URL is `***`.
    pub fn endpoint(&self) -> &str {
        &self.shown_endpoint
    }

    /// Sends one encoded `PushRequest`; error texts never carry the URL's password.
    pub fn send(&self, body: &[u8]) -> Outcome {
        match self.send_raw(body) {
            Outcome::Retry {
                reason,
                retry_after,
            } => Outcome::Retry {
                reason: scrub(&reason, &self.secrets),
                retry_after,
            },
            Outcome::Rejected { status, message } => Outcome::Rejected {
                status,
                message: scrub(&message, &self.secrets),
            },
            Outcome::Sent => Outcome::Sent,
        }
    }

    fn send_raw(&self, body: &[u8]) -> Outcome {
        let mut request = self
            .agent
            .post(&self.request_url)
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

    #[test]
    fn url_passwords_are_redacted() {
        assert_eq!(
            redact_url("http://user:s3cret@host:4040/p?q#f"),
            "http://user:***@host:4040/p?q#f"
        );
        assert_eq!(redact_url("https://t0ken@host"), "https://***@host");
        assert_eq!(redact_url("http://host:4040/a@b"), "http://host:4040/a@b");
        assert_eq!(redact_url("http://a:b@c@host/"), "http://a:***@host/");
        assert_eq!(redact_url("user:pw@host"), "***@host");
        assert_eq!(url_secrets("http://u:p%40ss@h"), ["p%40ss", "p@ss"]);
        assert!(url_secrets("http://h/x@y").is_empty());
        for bad in [
            "ftp://u:s3cret@h",
            "http://u:s3cret@h/?a=1",
            "http://u:s3cret@/",
            "http://u:s3cret@h h",
            "u:s3cret@h",
        ] {
            let err = validate_url(bad).unwrap_err();
            assert!(!err.contains("s3cret"), "{bad}: {err}");
            assert!(err.contains("***"), "{bad}: {err}");
        }
        let client = Client::new(&PushConfig::new("http://u:s3cret@127.0.0.1:1")).unwrap();
        assert_eq!(
            client.endpoint(),
            "http://u:***@127.0.0.1:1/push.v1.PusherService/Push"
        );
        assert_eq!(scrub("a s3cret b", &client.secrets), "a *** b");
    }
}
