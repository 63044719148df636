//! Pyroscope's legacy `/ingest` and Connect `Push`.
use super::*;

/// `POST /ingest`: Pyroscope's legacy ingest (docs/pyroscope-protocol.md §4).
pub async fn ingest(State(state): State<AppState>, request: Request) -> Result<Response, ApiError> {
    let store = state.store()?.clone();
    let limit = state.config.max_body_bytes;
    let params: HashMap<String, String> = axum::extract::Query::try_from_uri(request.uri())
        .map(|q| q.0)
        .map_err(|e| ApiError::invalid(format!("bad query string: {e}")))?;
    let name = params
        .get("name")
        .ok_or_else(|| ApiError::invalid("missing query parameter `name`"))?;
    let (app, mut labels) = parse_app_name(name).map_err(ApiError::invalid)?;
    let now = unix_now_ns();
    let time_param = |key: &str| -> Result<i64, ApiError> {
        match params.get(key) {
            None => Ok(now),
            Some(text) => ingest::parse_time(text, now).ok_or_else(|| {
                ApiError::invalid(format!("invalid `{key}` time `{}`", text.escape_debug()))
            }),
        }
    };
    let (from, until) = (time_param("from")?, time_param("until")?);
    if let Some(spy) = params.get("spyName") {
        labels.push(("pyroscope_spy".into(), spy.clone()));
    }
    let format = params.get("format").map(|f| f.to_ascii_lowercase());
    let content_type = request
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_ascii_lowercase();
    let is_multipart = content_type.starts_with("multipart/form-data");

    let profiles = match format.as_deref() {
        Some("pprof") | None if is_multipart || format.is_some() => {
            let (pprof_bytes, display_names) = if is_multipart {
                read_multipart(request, &state, limit).await?
            } else {
                (
                    connect::read_body(request.into_body(), limit)
                        .await?
                        .to_vec(),
                    HashMap::new(),
                )
            };
            // The body limit holds after decompression too (a small gzip can inflate a lot).
            let pprof = ingest::decode_pprof(&pprof_bytes, limit)?;
            ingest::validate_pprof(&pprof)?;
            let profile_name = derive_name(&pprof, &display_names);
            if !labels.iter().any(|(k, _)| k == "service_name") {
                labels.push(("service_name".into(), app));
            }
            ingest::validate_labels(&labels)?;
            ingest::profiles_from_pprof(&pprof, &profile_name, &labels, from)?
        }
        None | Some("folded") | Some("lines") => {
            if is_multipart {
                return Err(ApiError::unsupported_media(
                    "multipart bodies carry pprof; use format=pprof or send folded text",
                ));
            }
            let sample_rate = params
                .get("sampleRate")
                .and_then(|r| r.parse::<u32>().ok())
                .filter(|r| *r > 0)
                .unwrap_or(100);
            let (service, profile_type, factor) = ingest::text_profile_type(&app, sample_rate)?;
            let body = connect::read_body(request.into_body(), limit).await?;
            let (names, stacks) =
                ingest::parse_folded(&body, format.as_deref() == Some("lines"), factor)?;
            if labels.iter().any(|(k, _)| k == "service_name") {
                labels.push(("app_name".into(), service));
            } else {
                labels.push(("service_name".into(), service));
            }
            ingest::validate_labels(&labels)?;
            vec![NewProfile {
                profile_type: Some(profile_type),
                labels,
                time_ns: from,
                duration_ns: (until - from).max(0),
                // Time types scale each sample by the sample rate's period; counts have none.
                period: if factor > 1 { factor } else { 0 },
                names,
                frames: Vec::new(),
                stacks,
                spans: Vec::new(),
                labelled: Vec::new(),
            }]
        }
        Some(other) => {
            return Err(ApiError::unsupported_media(format!(
                "format `{}` is not supported (pprof, folded, lines)",
                other.escape_debug()
            )));
        }
    };
    save(store, profiles).await?;
    Ok(StatusCode::OK.into_response())
}

/// The `__name__` for an `/ingest` pprof, with `sample_type_config` display names applied.
fn derive_name(pprof: &proto::Profile, display_names: &HashMap<String, String>) -> String {
    if display_names.is_empty() {
        return ingest::derive_pprof_name(pprof);
    }
    let mut renamed = pprof.clone();
    for sample_type in &mut renamed.sample_type {
        let current = renamed
            .string_table
            .get(sample_type.r#type as usize)
            .cloned()
            .unwrap_or_default();
        if let Some(display) = display_names.get(&current) {
            renamed.string_table.push(display.clone());
            sample_type.r#type = renamed.string_table.len() as i64 - 1;
        }
    }
    ingest::derive_pprof_name(&renamed)
}

/// The `profile` (and optional `sample_type_config`) fields of a multipart upload.
async fn read_multipart(
    request: Request,
    state: &AppState,
    limit: usize,
) -> Result<(Vec<u8>, HashMap<String, String>), ApiError> {
    let (parts, body) = request.into_parts();
    let body = connect::read_body(body, limit).await?;
    let request = Request::from_parts(parts, Body::from(body));
    let mut multipart = Multipart::from_request(request, state)
        .await
        .map_err(|e| ApiError::invalid(format!("malformed multipart body: {}", e.body_text())))?;
    let mut profile = None;
    let mut display_names = HashMap::new();
    while let Some(field) = multipart
        .next_field()
        .await
        .map_err(|e| ApiError::invalid(format!("malformed multipart body: {}", e.body_text())))?
    {
        let name = field.name().unwrap_or("").to_owned();
        let bytes = field.bytes().await.map_err(|e| {
            ApiError::invalid(format!("malformed multipart body: {}", e.body_text()))
        })?;
        match name.as_str() {
            "profile" => profile = Some(bytes.to_vec()),
            "prev_profile" => {
                return Err(ApiError::invalid(
                    "unsupported client version: prev_profile is obsolete",
                ));
            }
            "sample_type_config" => {
                let config: HashMap<String, serde_json::Value> = serde_json::from_slice(&bytes)
                    .map_err(|e| ApiError::invalid(format!("malformed sample_type_config: {e}")))?;
                for (sample_type, settings) in config {
                    if let Some(display) = settings.get("display-name").and_then(|v| v.as_str()) {
                        display_names.insert(sample_type, display.to_owned());
                    }
                }
            }
            _ => {}
        }
    }
    let profile =
        profile.ok_or_else(|| ApiError::invalid("the multipart body has no `profile` field"))?;
    Ok((profile, display_names))
}

/// `POST /push.v1.PusherService/Push` (docs/pyroscope-protocol.md §3).
pub async fn push(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let store = state.store()?.clone();
    let limit = state.config.max_body_bytes;
    let (codec, body) = connect::read_request(&headers, body, limit).await?;
    let request: PushRequest = connect::decode(codec, &body)?;
    let now = unix_now_ns();
    let profiles = blocking(move || {
        let mut profiles = Vec::new();
        for series in &request.series {
            let labels: Vec<(String, String)> = series
                .labels
                .iter()
                .map(|l| (l.name.clone(), l.value.clone()))
                .collect();
            ingest::validate_labels(&labels)?;
            let explicit_name = labels
                .iter()
                .find(|(k, _)| k == "__name__")
                .map(|(_, v)| v.clone());
            let series_labels: Vec<(String, String)> = labels
                .into_iter()
                .filter(|(k, _)| k != "__name__" && k != "__delta__")
                .collect();
            for sample in &series.samples {
                let pprof = ingest::decode_pprof(&sample.raw_profile, limit)?;
                ingest::validate_pprof(&pprof)?;
                let name = explicit_name
                    .clone()
                    .unwrap_or_else(|| ingest::derive_pprof_name(&pprof));
                profiles.extend(ingest::profiles_from_pprof(
                    &pprof,
                    &name,
                    &series_labels,
                    now,
                )?);
            }
        }
        Ok::<_, ApiError>(profiles)
    })
    .await?;
    save(store, profiles).await?;
    Ok(connect::encode(codec, &PushResponse {}))
}
