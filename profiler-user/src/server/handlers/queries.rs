//! The Connect querier methods and the merged pprof download.
use super::*;

fn ms_to_ns(ms: i64) -> i64 {
    ms.saturating_mul(1_000_000)
}

/// (start, end) in ns; end 0 means now, start 0 means an hour before end.
fn time_range(start_ms: i64, end_ms: i64) -> (i64, i64) {
    let end = if end_ms <= 0 {
        unix_now_ns()
    } else {
        ms_to_ns(end_ms)
    };
    let start = if start_ms <= 0 {
        end - 3_600_000_000_000
    } else {
        ms_to_ns(start_ms)
    };
    (start, end)
}

fn optional_range(start_ms: i64, end_ms: i64) -> Option<(i64, i64)> {
    (start_ms > 0 || end_ms > 0).then(|| time_range(start_ms, end_ms))
}

/// Parses a label selector; one refused for its size is counted.
fn parse_selector(state: &AppState, text: &str) -> Result<Selector, ApiError> {
    Selector::parse(text).map_err(|err| {
        if err.is_limit() {
            state
                .health
                .selectors_rejected
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        ApiError::invalid(err)
    })
}

fn selection(
    state: &AppState,
    profile_type_id: &str,
    label_selector: &str,
    start: i64,
    end: i64,
) -> Result<Selection, ApiError> {
    ProfileType::parse(profile_type_id).map_err(store_error)?;
    let mut selector = parse_selector(state, label_selector)?;
    let span_ids = take_span_matchers(&mut selector)?;
    let (start_ns, end_ns) = time_range(start, end);
    if start_ns > end_ns {
        return Err(ApiError::invalid("start is after end"));
    }
    // A trailing `:delta` names the same series.
    let selection = Selection::new(
        profile_type_id.trim_end_matches(":delta").to_owned(),
        selector,
        start_ns,
        end_ns,
    );
    Ok(match span_ids {
        Some(ids) => selection.with_spans(ids),
        None => selection,
    })
}

/// Span ids are not series labels: a `span_id="…"` or `span_id=~"…|…"` matcher of a label
/// selector selects samples of those spans instead, as Pyroscope's query frontend reads it.
fn take_span_matchers(selector: &mut Selector) -> Result<Option<Vec<u64>>, ApiError> {
    let mut span_ids: Option<Vec<u64>> = None;
    let mut rest = Vec::with_capacity(selector.matchers.len());
    for matcher in std::mem::take(&mut selector.matchers) {
        if matcher.name != ingest::SPAN_ID_LABEL {
            rest.push(matcher);
            continue;
        }
        let values: Vec<&str> = match matcher.op {
            MatchOp::Equal => vec![matcher.value.as_str()],
            MatchOp::Regex => matcher.value.split('|').collect(),
            MatchOp::NotEqual | MatchOp::NotRegex => {
                return Err(ApiError::invalid(
                    "span_id can only be selected with = or =~ (a list of span ids separated by |)",
                ));
            }
        };
        let ids = values
            .iter()
            .map(|value| {
                ingest::parse_span_id(value).ok_or_else(|| {
                    ApiError::invalid(format!(
                        "`{}` is not a span id (up to 16 hex digits, not zero)",
                        value.escape_debug()
                    ))
                })
            })
            .collect::<Result<Vec<u64>, ApiError>>()?;
        // Several span_id matchers: a sample must satisfy each.
        span_ids = Some(match span_ids {
            None => ids,
            Some(before) => before.into_iter().filter(|id| ids.contains(id)).collect(),
        });
    }
    selector.matchers = rest;
    Ok(span_ids)
}

/// The span ids of `SelectMergeSpanProfile`'s `span_selector`.
fn span_selector(ids: &[String]) -> Result<Vec<u64>, ApiError> {
    if ids.len() > MAX_SPAN_SELECTOR {
        return Err(ApiError::invalid(format!(
            "{} span ids given, at most {MAX_SPAN_SELECTOR} are allowed",
            ids.len()
        )));
    }
    ids.iter()
        .map(|id| {
            ingest::parse_span_id(id).ok_or_else(|| {
                ApiError::invalid(format!(
                    "span_selector: `{}` is not a span id (up to 16 hex digits, not zero)",
                    id.escape_debug()
                ))
            })
        })
        .collect()
}

/// What a `SelectMergeStacktracesRequest` (also each side of a `Diff`) selects: its type,
/// label selector and range, id selectors and call site.
fn stacktraces_selection(
    state: &AppState,
    request: &SelectMergeStacktracesRequest,
) -> Result<Selection, ApiError> {
    let call_site = call_site(&request.stack_trace_selector)?;
    let mut selection = with_id_selectors(
        selection(
            state,
            &request.profile_type_id,
            &request.label_selector,
            request.start,
            request.end,
        )?,
        &request.profile_id_selector,
        &request.trace_id_selector,
        &request.span_selector,
    )?;
    selection.call_site = call_site;
    Ok(selection)
}

/// The id selectors of `SelectMergeStacktraces` and `SelectMergeProfile`: span and trace ids
/// keep only the samples of those spans and traces (an empty list selects by nothing);
/// profile ids are refused, as the store keeps no per-profile ids.
fn with_id_selectors(
    selection: Selection,
    profile_ids: &[String],
    trace_ids: &[String],
    span_ids: &[String],
) -> Result<Selection, ApiError> {
    if !profile_ids.is_empty() {
        return Err(ApiError::new(
            StatusCode::NOT_IMPLEMENTED,
            "unimplemented",
            "profile_id_selector is not supported: the store merges each series' profiles per \
             interval and keeps no profile ids",
        ));
    }
    let mut selection = selection;
    if !span_ids.is_empty() {
        selection = selection.with_spans(span_selector(span_ids)?);
    }
    if !trace_ids.is_empty() {
        if trace_ids.len() > MAX_SPAN_SELECTOR {
            return Err(ApiError::invalid(format!(
                "{} trace ids given, at most {MAX_SPAN_SELECTOR} are allowed",
                trace_ids.len()
            )));
        }
        if let Some(bad) = trace_ids
            .iter()
            .find(|id| id.is_empty() || id.len() > 32 || !id.bytes().all(|b| b.is_ascii_hexdigit()))
        {
            return Err(ApiError::invalid(format!(
                "trace_id_selector: `{}` is not a trace id (up to 32 hex digits)",
                bad.escape_debug()
            )));
        }
        selection = selection.with_traces(trace_ids);
    }
    Ok(selection)
}

/// Most span ids one `SelectMergeSpanProfile` may name (a trace has a few hundred spans).
const MAX_SPAN_SELECTOR: usize = 10_000;

/// The `matchers` of LabelNames, LabelValues and Series: at most [`MAX_MATCHERS`] selectors
/// (each within the limits of one selector).
fn selectors(state: &AppState, matchers: &[String]) -> Result<Vec<Selector>, ApiError> {
    if matchers.len() > MAX_MATCHERS {
        state
            .health
            .selectors_rejected
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        return Err(ApiError::invalid(format!(
            "{} matchers given, at most {MAX_MATCHERS} are allowed",
            matchers.len()
        )));
    }
    matchers.iter().map(|m| parse_selector(state, m)).collect()
}

/// The call site of a `stack_trace_selector` (root-first function names; empty: none). A Go
/// PGO selector is refused, not ignored, here: it shapes a pprof's locations, so only
/// `SelectMergeProfile` answers it (answering the whole profile instead would be silently
/// wrong).
fn call_site(selector: &Option<StackTraceSelector>) -> Result<Vec<String>, ApiError> {
    let Some(selector) = selector else {
        return Ok(Vec::new());
    };
    if selector.go_pgo.is_some() {
        return Err(ApiError::new(
            StatusCode::NOT_IMPLEMENTED,
            "unimplemented",
            "stack_trace_selector.go_pgo shapes a pprof's locations: only SelectMergeProfile \
             answers it",
        ));
    }
    Ok(selector
        .call_site
        .iter()
        .map(|location| location.name.clone())
        .collect())
}

/// Whether a request's `format` asks for Pyroscope's tree bytes (2) rather than a flame
/// graph (0, 1).
fn tree_format(format: i32) -> Result<bool, ApiError> {
    match format {
        0 | 1 => Ok(false),
        2 => Ok(true),
        other => Err(ApiError::invalid(format!(
            "unknown profile format {other} (1: flame graph, 2: tree)"
        ))),
    }
}

/// The merged call tree of a selection as a flame graph or as tree bytes: the answer of
/// `SelectMergeStacktraces` and `SelectMergeSpanProfile` (the same message).
fn merged_stacktraces(
    store: &Store,
    selection: &Selection,
    as_tree: bool,
    max_nodes: usize,
) -> Result<SelectMergeStacktracesResponse, ApiError> {
    let tree = store.merge(selection).map_err(store_error)?;
    Ok(if as_tree {
        SelectMergeStacktracesResponse {
            flamegraph: None,
            tree: render::tree_bytes(&tree, max_nodes),
        }
    } else {
        SelectMergeStacktracesResponse {
            flamegraph: Some(render::flamegraph(&tree, max_nodes)),
            tree: Vec::new(),
        }
    })
}

fn max_nodes(requested: Option<i64>) -> usize {
    match requested {
        Some(n) if n > 0 => n as usize,
        _ => render::DEFAULT_MAX_NODES,
    }
}

/// `POST /querier.v1.QuerierService/{method}`.
pub async fn querier(
    State(state): State<AppState>,
    Path(method): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let store = state.store()?.clone();
    let (codec, body) = connect::read_request(&headers, body, state.config.max_body_bytes).await?;
    match method.as_str() {
        "ProfileTypes" => {
            let request: ProfileTypesRequest = connect::decode(codec, &body)?;
            let range = optional_range(request.start, request.end);
            let series = bounded_query(&state, move || Ok(store.series(range))).await?;
            let mut ids: Vec<String> = series.into_iter().map(|s| s.profile_type).collect();
            // Off-CPU profiles make a wall-clock view of their services (store::wall_series).
            if ids.iter().any(|id| id == OFF_CPU_TYPE) {
                ids.push(WALL_TYPE.to_owned());
            }
            ids.sort();
            ids.dedup();
            let profile_types = ids
                .iter()
                .filter_map(|id| ProfileType::parse(id).ok())
                .map(|t| api::ProfileType {
                    id: t.id(),
                    name: t.name,
                    sample_type: t.sample_type,
                    sample_unit: t.sample_unit,
                    period_type: t.period_type,
                    period_unit: t.period_unit,
                })
                .collect();
            Ok(connect::encode(
                codec,
                &ProfileTypesResponse { profile_types },
            ))
        }
        "LabelNames" => {
            let request: LabelNamesRequest = connect::decode(codec, &body)?;
            let selectors = selectors(&state, &request.matchers)?;
            let range = optional_range(request.start, request.end);
            let names =
                bounded_query(&state, move || Ok(store.label_names(&selectors, range))).await?;
            Ok(connect::encode(codec, &LabelNamesResponse { names }))
        }
        "LabelValues" => {
            let request: LabelValuesRequest = connect::decode(codec, &body)?;
            let selectors = selectors(&state, &request.matchers)?;
            let range = optional_range(request.start, request.end);
            let name = request.name;
            let names = bounded_query(&state, move || {
                let mut names = store.label_values(&name, &selectors, range);
                // Span labels live with the samples (a store from before kept span_name as
                // a series label: both are listed).
                names.extend(
                    store
                        .span_label_values(&name, &selectors, range)
                        .map_err(store_error)?,
                );
                names.sort();
                names.dedup();
                Ok(names)
            })
            .await?;
            Ok(connect::encode(codec, &LabelValuesResponse { names }))
        }
        "Series" => {
            let request: SeriesRequest = connect::decode(codec, &body)?;
            let selectors = selectors(&state, &request.matchers)?;
            let range = optional_range(request.start, request.end);
            let series = bounded_query(&state, move || Ok(store.series(range))).await?;
            let mut sets: Vec<Vec<LabelPair>> = series
                .into_iter()
                .filter(|s| {
                    selectors.is_empty() || selectors.iter().any(|sel| sel.matches(&s.labels))
                })
                .map(|s| {
                    s.labels
                        .into_iter()
                        .filter(|(k, _)| {
                            request.label_names.is_empty() || request.label_names.contains(k)
                        })
                        .map(|(name, value)| LabelPair { name, value })
                        .collect()
                })
                .collect();
            sets.sort();
            sets.dedup();
            let labels_set = sets.into_iter().map(|labels| Labels { labels }).collect();
            Ok(connect::encode(codec, &SeriesResponse { labels_set }))
        }
        "SelectMergeStacktraces" => {
            let request: SelectMergeStacktracesRequest = connect::decode(codec, &body)?;
            let as_tree = tree_format(request.format)?;
            let selection = stacktraces_selection(&state, &request)?;
            let max_nodes = max_nodes(request.max_nodes);
            let response = bounded_query(&state, move || {
                merged_stacktraces(&store, &selection, as_tree, max_nodes)
            })
            .await?;
            Ok(connect::encode(codec, &response))
        }
        "SelectMergeSpanProfile" => {
            let request: SelectMergeSpanProfileRequest = connect::decode(codec, &body)?;
            let as_tree = tree_format(request.format)?;
            let span_ids = span_selector(&request.span_selector)?;
            let selection = selection(
                &state,
                &request.profile_type_id,
                &request.label_selector,
                request.start,
                request.end,
            )?;
            // Span ids in the label selector too: a sample must be in both lists.
            let selection = selection.with_spans(span_ids);
            let max_nodes = max_nodes(request.max_nodes);
            let response = bounded_query(&state, move || {
                merged_stacktraces(&store, &selection, as_tree, max_nodes)
            })
            .await?;
            Ok(connect::encode(codec, &response))
        }
        "Diff" => {
            let request: DiffRequest = connect::decode(codec, &body)?;
            let (Some(left), Some(right)) = (request.left, request.right) else {
                return Err(ApiError::invalid("Diff needs both `left` and `right`"));
            };
            let left_selection = stacktraces_selection(&state, &left)?;
            let right_selection = stacktraces_selection(&state, &right)?;
            let max_nodes = max_nodes(left.max_nodes.or(right.max_nodes));
            let flamegraph = bounded_query(&state, move || {
                let left = store.merge(&left_selection).map_err(store_error)?;
                let right = store.merge(&right_selection).map_err(store_error)?;
                Ok(render::flamegraph_diff(&left, &right, max_nodes))
            })
            .await?;
            Ok(connect::encode(
                codec,
                &DiffResponse {
                    flamegraph: Some(flamegraph),
                },
            ))
        }
        "SelectMergeProfile" => {
            let request: SelectMergeProfileRequest = connect::decode(codec, &body)?;
            // Go PGO: the whole profile, shaped afterwards (a call site is then ignored).
            let go_pgo = request
                .stack_trace_selector
                .as_ref()
                .and_then(|selector| selector.go_pgo.clone());
            let call_site = match go_pgo {
                Some(_) => Vec::new(),
                None => call_site(&request.stack_trace_selector)?,
            };
            let mut selection = with_id_selectors(
                selection(
                    &state,
                    &request.profile_type_id,
                    &request.label_selector,
                    request.start,
                    request.end,
                )?,
                &request.profile_id_selector,
                &request.trace_id_selector,
                &[],
            )?;
            selection.call_site = call_site;
            let profile = bounded_query(&state, move || {
                let mut profile = merged_pprof(&store, &selection)?;
                if let Some(pgo) = go_pgo {
                    render::apply_go_pgo(&mut profile, pgo.keep_locations, pgo.aggregate_callees);
                }
                Ok(profile)
            })
            .await?;
            if codec == Codec::Json {
                // Proto3's JSON form of the pprof message, as Connect JSON clients decode it.
                return Ok((
                    StatusCode::OK,
                    [(
                        header::CONTENT_TYPE,
                        HeaderValue::from_static("application/json"),
                    )],
                    proto::profile_json(&profile).to_string(),
                )
                    .into_response());
            }
            Ok((
                StatusCode::OK,
                [(
                    header::CONTENT_TYPE,
                    HeaderValue::from_static("application/proto"),
                )],
                profile.encode_to_vec(),
            )
                .into_response())
        }
        "SelectSeries" => {
            let request: SelectSeriesRequest = connect::decode(codec, &body)?;
            let call_site = call_site(&request.stack_trace_selector)?;
            let mut selection = selection(
                &state,
                &request.profile_type_id,
                &request.label_selector,
                request.start,
                request.end,
            )?;
            selection.call_site = call_site;
            let series =
                bounded_query(&state, move || select_series(&store, &selection, &request)).await?;
            Ok(connect::encode(codec, &SelectSeriesResponse { series }))
        }
        "AnalyzeQuery" => {
            let request: AnalyzeQueryRequest = connect::decode(codec, &body)?;
            let (profile_type, label_selector) = split_query(request.query.trim());
            let selection = selection(
                &state,
                profile_type,
                label_selector,
                request.start,
                request.end,
            )?;
            let analysis = bounded_query(&state, move || {
                store.analyze(&selection).map_err(store_error)
            })
            .await?;
            // One component, the embedded store, reads everything: no replicas to dedupe.
            let response = AnalyzeQueryResponse {
                query_scopes: vec![QueryScope {
                    component_type: "embedded store".into(),
                    component_count: 1,
                    block_count: analysis.spaces,
                    series_count: analysis.series,
                    profile_count: analysis.profiles,
                    sample_count: analysis.stack_entries,
                    index_bytes: 0,
                    profile_bytes: analysis.profile_bytes,
                    symbol_bytes: 0,
                }],
                query_impact: Some(QueryImpact {
                    total_bytes_in_time_range: analysis.bytes_in_range,
                    total_queried_series: analysis.series,
                    deduplication_needed: false,
                }),
            };
            Ok(connect::encode(codec, &response))
        }
        "GetProfileStats" => {
            let series = bounded_query(&state, move || Ok(store.series(None))).await?;
            let response = GetProfileStatsResponse {
                data_ingested: !series.is_empty(),
                oldest_profile_time: series
                    .iter()
                    .map(|s| s.first_ns / 1_000_000)
                    .min()
                    .unwrap_or(0),
                newest_profile_time: series
                    .iter()
                    .map(|s| s.last_ns / 1_000_000)
                    .max()
                    .unwrap_or(0),
            };
            Ok(connect::encode(codec, &response))
        }
        // Grafana calls it only behind its `profilesHeatmap` feature toggle.
        "SelectHeatmap" => Err(ApiError::new(
            StatusCode::NOT_IMPLEMENTED,
            "unimplemented",
            "SelectHeatmap is not supported: its points refer to individual profiles and span \
             exemplars by id, which the embedded store does not keep",
        )),
        other => Err(ApiError::not_found(format!(
            "unknown method querier.v1.QuerierService/{}",
            other.escape_debug()
        ))),
    }
}

/// Series whose labels a downloaded pprof carries on its samples (one merge each); a
/// selection of more is merged into one tree, and the pprof's comment says so.
const MAX_LABELLED_SERIES: usize = 256;

/// The selection merged as a pprof whose samples carry their series' labels (SDK tags,
/// `thread_name`, `executable`, `service_name`...), as Pyroscope's pprof keeps them.
fn merged_pprof(store: &Store, selection: &Selection) -> Result<proto::Profile, ApiError> {
    let profile_type = ProfileType::parse(&selection.profile_type).map_err(store_error)?;
    match store
        .merge_each_series(selection, MAX_LABELLED_SERIES)
        .map_err(store_error)?
    {
        Some(parts) => {
            let parts: Vec<(&[(String, String)], &MergedTree)> = parts
                .iter()
                .map(|(series, tree)| (series.labels.as_slice(), tree))
                .collect();
            Ok(render::pprof_of_parts(
                &parts,
                &profile_type,
                selection.start_ns,
                selection.end_ns,
                None,
            ))
        }
        None => {
            let tree = store.merge_with_frames(selection).map_err(store_error)?;
            let comment = format!(
                "samples without labels: the selection has more than {MAX_LABELLED_SERIES} series"
            );
            Ok(render::pprof_of_parts(
                &[(&[][..], &tree)],
                &profile_type,
                selection.start_ns,
                selection.end_ns,
                Some(&comment),
            ))
        }
    }
}

/// Buckets profile totals at `start, start+step, ...`; a point's timestamp is its bucket's right
/// edge and covers `(edge - step, edge]`; one series per distinct group-by label values.
fn select_series(
    store: &Store,
    selection: &Selection,
    request: &SelectSeriesRequest,
) -> Result<Vec<Series>, ApiError> {
    let step_ns = if request.step.is_finite() && request.step > 0.0 {
        (request.step * 1e9) as i64
    } else {
        15_000_000_000
    }
    .max(1_000_000);
    let average = request.aggregation == Some(1);
    let mut groups: HashMap<Vec<LabelPair>, std::collections::BTreeMap<i64, (f64, u64)>> =
        HashMap::new();
    for (series, points) in store.totals(selection).map_err(store_error)? {
        let key: Vec<LabelPair> = request
            .group_by
            .iter()
            .filter_map(|name| {
                series
                    .labels
                    .iter()
                    .find(|(k, _)| k == name)
                    .map(|(k, v)| LabelPair {
                        name: k.clone(),
                        value: v.clone(),
                    })
            })
            .collect();
        let buckets = groups.entry(key).or_default();
        for (time_ns, total) in points {
            // In i128: the range and step come from the client and may be extreme.
            let (start, step) = (i128::from(selection.start_ns), i128::from(step_ns));
            let index = (i128::from(time_ns) - start + step - 1).div_euclid(step);
            let edge = (start + index * step).clamp(i64::MIN.into(), i64::MAX.into()) as i64;
            let bucket = buckets.entry(edge).or_default();
            bucket.0 += total as f64;
            bucket.1 += 1;
        }
    }
    let mut series: Vec<Series> = groups
        .into_iter()
        .map(|(labels, buckets)| Series {
            labels,
            points: buckets
                .into_iter()
                .map(|(edge, (sum, count))| Point {
                    value: if average { sum / count as f64 } else { sum },
                    timestamp: edge / 1_000_000,
                })
                .collect(),
        })
        .collect();
    series.sort_by(|a, b| a.labels.cmp(&b.labels));
    if let Some(limit) = request.limit.filter(|l| *l > 0) {
        let total = |s: &Series| s.points.iter().map(|p| p.value).sum::<f64>();
        series.sort_by(|a, b| total(b).total_cmp(&total(a)));
        series.truncate(limit as usize);
    }
    Ok(series)
}

/// `GET /api/pprof?query=<type>{selector}&from=<ms>&until=<ms>`: the merged profile as a
/// gzipped pprof file (the UI's download button).
pub async fn pprof_download(State(state): State<AppState>, uri: Uri) -> Result<Response, ApiError> {
    let store = state.store()?.clone();
    let params: HashMap<String, String> = axum::extract::Query::try_from_uri(&uri)
        .map(|q| q.0)
        .map_err(|e| ApiError::invalid(format!("bad query string: {e}")))?;
    let query = params.get("query").ok_or_else(|| {
        ApiError::invalid("missing query parameter `query` (<profile type>{selector})")
    })?;
    let (profile_type, selector) = match query.find('{') {
        Some(pos) => (&query[..pos], &query[pos..]),
        None => (query.as_str(), "{}"),
    };
    let ms = |key: &str| -> Result<i64, ApiError> {
        params.get(key).map_or(Ok(0), |v| {
            v.parse().map_err(|_| {
                ApiError::invalid(format!("`{key}` must be milliseconds since the epoch"))
            })
        })
    };
    let selection = selection(&state, profile_type, selector, ms("from")?, ms("until")?)?;
    let profile = bounded_query(&state, move || merged_pprof(&store, &selection)).await?;
    let body = crate::store::ingest::gzip(&profile.encode_to_vec());
    Ok((
        StatusCode::OK,
        [
            (
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/octet-stream"),
            ),
            (
                header::CONTENT_DISPOSITION,
                HeaderValue::from_static("attachment; filename=\"profile.pb.gz\""),
            ),
        ],
        body,
    )
        .into_response())
}

/// The query string of a GET request.
fn query_params(uri: &Uri) -> Result<HashMap<String, String>, ApiError> {
    axum::extract::Query::try_from_uri(uri)
        .map(|q| q.0)
        .map_err(|e| ApiError::invalid(format!("bad query string: {e}")))
}

/// `<profile type>{selector}` → (profile type, selector).
fn split_query(query: &str) -> (&str, &str) {
    match query.find('{') {
        Some(pos) => (&query[..pos], &query[pos..]),
        None => (query, "{}"),
    }
}

/// A render API time (`now`, `now-1h`, Unix seconds or milliseconds) in milliseconds; `default`
/// when absent.
fn render_time(
    params: &HashMap<String, String>,
    key: &str,
    default: &str,
    now_ns: i64,
) -> Result<i64, ApiError> {
    let text = params.get(key).map_or(default, String::as_str);
    crate::store::ingest::parse_time(text, now_ns)
        .map(|ns| ns / 1_000_000)
        .ok_or_else(|| {
            ApiError::invalid(format!(
                "`{key}` must be now, now-<n><s|m|h|d|w>, or Unix seconds or milliseconds"
            ))
        })
}

/// One side of a render request: the selection and the profile type it names.
fn render_selection(
    state: &AppState,
    params: &HashMap<String, String>,
    [query_key, from_key, until_key]: [&str; 3],
) -> Result<(Selection, ProfileType), ApiError> {
    let query = params.get(query_key).ok_or_else(|| {
        ApiError::invalid(format!(
            "missing `{query_key}` (<profile type>{{selector}})"
        ))
    })?;
    let (profile_type, selector) = split_query(query);
    let now_ns = unix_now_ns();
    let until = render_time(params, until_key, "now", now_ns)?;
    let from = render_time(params, from_key, "now-1h", now_ns)?;
    let selection = selection(state, profile_type, selector, from, until)?;
    let parsed = ProfileType::parse(profile_type).map_err(store_error)?;
    Ok((selection, parsed))
}

/// Only JSON is answered (the flamebearer format); Pyroscope's other render formats are not.
fn check_render_format(params: &HashMap<String, String>) -> Result<(), ApiError> {
    match params.get("format").map(String::as_str) {
        None | Some("json") => Ok(()),
        Some(other) => Err(ApiError::new(
            StatusCode::NOT_IMPLEMENTED,
            "unimplemented",
            format!(
                "format={} is not supported: only json (flamebearer) is",
                other.escape_debug()
            ),
        )),
    }
}

/// The flamebearer `metadata` of a profile type: units and sample rate as Pyroscope's own
/// render API sets them (CPU time in nanoseconds reads as samples at 1e9 per second).
fn flamebearer_metadata(profile_type: &ProfileType, format: &str) -> serde_json::Value {
    let sample_type = profile_type.sample_type.as_str();
    let (units, sample_rate) = if sample_type == "cpu" {
        ("samples", 1_000_000_000)
    } else if sample_type.ends_with("objects")
        || matches!(sample_type, "goroutine" | "goroutines" | "samples")
        || profile_type.sample_unit == "count"
    {
        ("objects", 100)
    } else if profile_type.sample_unit == "bytes" {
        ("bytes", 100)
    } else {
        (profile_type.sample_unit.as_str(), 100)
    };
    serde_json::json!({
        "format": format,
        "spyName": "",
        "sampleRate": sample_rate,
        "units": units,
        "name": profile_type.name,
    })
}

/// The `flamebearer` object of a render answer: the querier's flame graph fields renamed.
fn flamebearer(names: &[String], levels: &[Level], total: i64, max_self: i64) -> serde_json::Value {
    let levels: Vec<&[i64]> = levels.iter().map(|level| level.values.as_slice()).collect();
    serde_json::json!({
        "names": names,
        "levels": levels,
        "numTicks": total,
        "maxSelf": max_self,
    })
}

fn json_response(value: &serde_json::Value) -> Response {
    (
        StatusCode::OK,
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        value.to_string(),
    )
        .into_response()
}

/// `GET /pyroscope/render?query=<type>{selector}&from=&until=[&max-nodes=][&format=json]`:
/// Pyroscope's HTTP render API, the merged profile as flamebearer JSON (levels of
/// `[x delta, total, self, name index]`, as the querier's flame graph) with a timeline.
pub async fn render_single(State(state): State<AppState>, uri: Uri) -> Result<Response, ApiError> {
    let store = state.store()?.clone();
    let params = query_params(&uri)?;
    check_render_format(&params)?;
    let (selection, profile_type) = render_selection(&state, &params, ["query", "from", "until"])?;
    let max_nodes = max_nodes(params.get("max-nodes").and_then(|n| n.parse().ok()));
    // About a thousand timeline points, at least 10 s apart.
    let step_s = ((selection.end_ns - selection.start_ns) / 1_000_000_000 / 1000).max(10);
    let request = SelectSeriesRequest {
        step: step_s as f64,
        ..SelectSeriesRequest::default()
    };
    let start_ns = selection.start_ns;
    let span_ms = (selection.end_ns - selection.start_ns) / 1_000_000;
    let (flamegraph, series) = bounded_query(&state, move || {
        let tree = store.merge(&selection).map_err(store_error)?;
        let series = select_series(&store, &selection, &request)?;
        Ok((render::flamegraph(&tree, max_nodes), series))
    })
    .await?;
    // Buckets end at start + k·step (see select_series); the timeline's k-th sample is bucket k+1.
    let step_ms = step_s * 1000;
    let buckets = (span_ms.max(1) + step_ms - 1) / step_ms;
    let mut samples = vec![0f64; buckets.clamp(1, 100_000) as usize];
    for point in series.iter().flat_map(|s| &s.points) {
        let index = (point.timestamp - start_ns / 1_000_000) / step_ms - 1;
        if let Some(slot) = usize::try_from(index).ok().and_then(|i| samples.get_mut(i)) {
            *slot += point.value;
        }
    }
    Ok(json_response(&serde_json::json!({
        "version": 1,
        "flamebearer": flamebearer(
            &flamegraph.names,
            &flamegraph.levels,
            flamegraph.total,
            flamegraph.max_self,
        ),
        "metadata": flamebearer_metadata(&profile_type, "single"),
        "timeline": {
            "startTime": start_ns / 1_000_000_000,
            "samples": samples,
            "durationDelta": step_s,
        },
        "groups": {},
    })))
}

/// `GET /pyroscope/render-diff?leftQuery=&leftFrom=&leftUntil=&rightQuery=&rightFrom=&rightUntil=
/// [&max-nodes=][&format=json]`: two selections as one flamebearer of format `double` (levels
/// of `[left x delta, left total, left self, right x delta, right total, right self, name
/// index]`), as Grafana's Profiles Drilldown asks for its diff view.
pub async fn render_diff(State(state): State<AppState>, uri: Uri) -> Result<Response, ApiError> {
    let store = state.store()?.clone();
    let params = query_params(&uri)?;
    check_render_format(&params)?;
    let (left, left_type) =
        render_selection(&state, &params, ["leftQuery", "leftFrom", "leftUntil"])?;
    let (right, _) = render_selection(&state, &params, ["rightQuery", "rightFrom", "rightUntil"])?;
    if left.profile_type != right.profile_type {
        return Err(ApiError::invalid(
            "leftQuery and rightQuery must name the same profile type",
        ));
    }
    let max_nodes = max_nodes(params.get("max-nodes").and_then(|n| n.parse().ok()));
    let diff = bounded_query(&state, move || {
        let left = store.merge(&left).map_err(store_error)?;
        let right = store.merge(&right).map_err(store_error)?;
        Ok(render::flamegraph_diff(&left, &right, max_nodes))
    })
    .await?;
    Ok(json_response(&serde_json::json!({
        "version": 1,
        "flamebearer": flamebearer(&diff.names, &diff.levels, diff.total, diff.max_self),
        "metadata": flamebearer_metadata(&left_type, "double"),
        "leftTicks": diff.left_ticks,
        "rightTicks": diff.right_ticks,
        "timeline": null,
    })))
}

/// `POST /settings.v1.SettingsService/{Get,Set}` (Connect, protobuf or JSON): the settings
/// Grafana's apps keep, persisted in the store.
pub async fn settings(
    State(state): State<AppState>,
    Path(method): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let store = state.store()?.clone();
    let (codec, body) = connect::read_request(&headers, body, state.config.max_body_bytes).await?;
    let to_wire = |setting: crate::store::Setting| api::Setting {
        name: setting.name,
        value: setting.value,
        modified_at: setting.modified_ms,
    };
    match method.as_str() {
        "Get" => {
            let _: api::GetSettingsRequest = connect::decode(codec, &body)?;
            let settings =
                bounded_query(&state, move || store.user_settings().map_err(store_error)).await?;
            Ok(connect::encode(
                codec,
                &api::GetSettingsResponse {
                    settings: settings.into_iter().map(to_wire).collect(),
                },
            ))
        }
        "Set" => {
            let request: api::SetSettingsRequest = connect::decode(codec, &body)?;
            let setting = request
                .setting
                .ok_or_else(|| ApiError::invalid("Set needs a `setting`"))?;
            let setting = crate::store::Setting {
                name: setting.name,
                value: setting.value,
                modified_ms: setting.modified_at,
            };
            let now_ms = unix_now_ns() / 1_000_000;
            let stored = bounded_query(&state, move || {
                store.set_user_setting(setting, now_ms).map_err(store_error)
            })
            .await?;
            Ok(connect::encode(
                codec,
                &api::SetSettingsResponse {
                    setting: Some(to_wire(stored)),
                },
            ))
        }
        other => Err(ApiError::not_found(format!(
            "unknown method settings.v1.SettingsService/{}",
            other.escape_debug()
        ))),
    }
}
