//! Connect unary protocol on axum (docs/pyroscope-protocol.md §2, §7.1): a POST whose body is a
//! protobuf (`application/proto`) or canonical JSON (`application/json`) message, optionally
//! gzipped as a whole (`Content-Encoding: gzip`); the response uses the request's codec; errors
//! are JSON `{"code", "message"}` with the HTTP status of the Connect code.
use axum::{
    body::{Body, Bytes},
    http::{HeaderMap, HeaderValue, StatusCode, header},
    response::{IntoResponse, Response},
};
use serde::{Serialize, de::DeserializeOwned};

use crate::store::ingest::{IngestError, gunzip};

/// An error answered to the client as Connect's JSON error body.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: &'static str,
    pub message: String,
}

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            code,
            message: message.into(),
        }
    }

    pub fn invalid(message: impl std::fmt::Display) -> ApiError {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_argument",
            message.to_string(),
        )
    }

    pub fn internal(message: impl std::fmt::Display) -> ApiError {
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            message.to_string(),
        )
    }

    pub fn too_large(limit: usize) -> ApiError {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "resource_exhausted",
            format!("the request body is larger than {limit} bytes"),
        )
    }

    pub fn unsupported_media(message: impl Into<String>) -> ApiError {
        ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "invalid_argument",
            message,
        )
    }

    pub fn not_found(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::NOT_FOUND, "unimplemented", message)
    }
}

impl From<IngestError> for ApiError {
    fn from(err: IngestError) -> ApiError {
        match err {
            IngestError::TooLarge { limit } => ApiError::too_large(limit),
            other => ApiError::invalid(other),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        // One line whatever a message echoes (messages quote client input).
        let message: String = self
            .message
            .chars()
            .flat_map(|c| {
                let escaped: Vec<char> = if c.is_control() {
                    c.escape_default().collect()
                } else {
                    vec![c]
                };
                escaped
            })
            .collect();
        let body = serde_json::json!({ "code": self.code, "message": message });
        (
            self.status,
            [(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            )],
            body.to_string(),
        )
            .into_response()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Codec {
    Proto,
    Json,
}

impl Codec {
    pub fn from_headers(headers: &HeaderMap) -> Result<Codec, ApiError> {
        let content_type = headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        let essence = content_type
            .split(';')
            .next()
            .unwrap_or("")
            .trim()
            .to_ascii_lowercase();
        match essence.as_str() {
            "application/proto" | "application/protobuf" | "application/x-protobuf" => {
                Ok(Codec::Proto)
            }
            "application/json" => Ok(Codec::Json),
            "" => Err(ApiError::unsupported_media(
                "missing Content-Type: expected application/proto or application/json",
            )),
            other => Err(ApiError::unsupported_media(format!(
                "unsupported Content-Type `{other}`: expected application/proto or application/json"
            ))),
        }
    }

    fn content_type(self) -> &'static str {
        match self {
            Codec::Proto => "application/proto",
            Codec::Json => "application/json",
        }
    }
}

/// Reads a request body up to `limit` bytes, as received (still compressed).
pub async fn read_body(body: Body, limit: usize) -> Result<Bytes, ApiError> {
    axum::body::to_bytes(body, limit).await.map_err(|err| {
        // The only error with a length-limit source is the limit itself.
        let message = err.to_string();
        if std::error::Error::source(&err).is_some_and(|s| s.to_string().contains("length limit"))
            || message.contains("length limit")
        {
            ApiError::too_large(limit)
        } else {
            ApiError::new(
                StatusCode::REQUEST_TIMEOUT,
                "canceled",
                format!("cannot read the request body: {message}"),
            )
        }
    })
}

/// A Connect unary request's codec and message bytes: the body read within `limit`, its
/// `Content-Encoding` undone.
pub async fn read_request(
    headers: &HeaderMap,
    body: Body,
    limit: usize,
) -> Result<(Codec, Bytes), ApiError> {
    let codec = Codec::from_headers(headers)?;
    let body = read_body(body, limit).await?;
    let body = decode_content_encoding(headers, body, limit)?;
    Ok((codec, body))
}

/// Undoes `Content-Encoding` (gzip or identity) with the same size limit after decompression.
pub fn decode_content_encoding(
    headers: &HeaderMap,
    body: Bytes,
    limit: usize,
) -> Result<Bytes, ApiError> {
    let encoding = headers
        .get(header::CONTENT_ENCODING)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("identity")
        .trim()
        .to_ascii_lowercase();
    match encoding.as_str() {
        "" | "identity" => Ok(body),
        "gzip" => Ok(Bytes::from(gunzip(&body, limit)?)),
        other => Err(ApiError::unsupported_media(format!(
            "unsupported Content-Encoding `{other}` (gzip or identity)"
        ))),
    }
}

/// Decodes a Connect unary request message.
pub fn decode<T: prost::Message + Default + DeserializeOwned>(
    codec: Codec,
    body: &[u8],
) -> Result<T, ApiError> {
    match codec {
        Codec::Proto => T::decode(body)
            .map_err(|e| ApiError::invalid(format!("malformed protobuf request: {e}"))),
        Codec::Json if body.is_empty() => Ok(T::default()),
        Codec::Json => serde_json::from_slice(body)
            .map_err(|e| ApiError::invalid(format!("malformed JSON request: {e}"))),
    }
}

/// Encodes a Connect unary response message in the request's codec.
pub fn encode<T: prost::Message + Serialize>(codec: Codec, message: &T) -> Response {
    let body = match codec {
        Codec::Proto => message.encode_to_vec(),
        Codec::Json => match serde_json::to_vec(message) {
            Ok(body) => body,
            Err(err) => return ApiError::internal(err).into_response(),
        },
    };
    (
        StatusCode::OK,
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static(codec.content_type()),
        )],
        body,
    )
        .into_response()
}
