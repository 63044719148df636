//! PromQL-style label selectors (`{service_name="api", env!~"dev|test"}`), as Grafana and the
//! Pyroscope API send them, and the legacy `/ingest` application name (`app{k=v,k2=v2}`).
use regex::Regex;

/// Most matchers one selector may have (a real one has a handful; 200,000 took 36 s).
pub const MAX_MATCHERS: usize = 64;
/// Longest selector text, in bytes.
pub const MAX_SELECTOR_BYTES: usize = 16 << 10;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SelectorError {
    // Input is echoed escaped, so a message stays one line whatever the client sent.
    #[error("invalid label selector `{}`: {reason}", .selector.escape_debug())]
    Syntax { selector: String, reason: String },
    #[error(
        "invalid regular expression `{}` in label selector: {}",
        .pattern.escape_debug(),
        .reason.escape_debug()
    )]
    Regex { pattern: String, reason: String },
    #[error("invalid application name `{}`: {reason}", .name.escape_debug())]
    AppName { name: String, reason: &'static str },
    #[error("label selector of {bytes} bytes is longer than the limit of {MAX_SELECTOR_BYTES}")]
    TooLong { bytes: usize },
    #[error("label selector has more than {MAX_MATCHERS} matchers")]
    TooManyMatchers,
}

impl SelectorError {
    /// Whether the selector was refused for its size rather than its syntax.
    pub fn is_limit(&self) -> bool {
        matches!(
            self,
            SelectorError::TooLong { .. } | SelectorError::TooManyMatchers
        )
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MatchOp {
    Equal,
    NotEqual,
    Regex,
    NotRegex,
}

#[derive(Clone, Debug)]
pub struct Matcher {
    pub name: String,
    pub op: MatchOp,
    pub value: String,
    regex: Option<Regex>,
}

impl Matcher {
    pub fn new(name: &str, op: MatchOp, value: &str) -> Result<Matcher, SelectorError> {
        let regex = match op {
            MatchOp::Regex | MatchOp::NotRegex => {
                // PromQL regexes are anchored at both ends.
                Some(
                    Regex::new(&format!("^(?:{value})$")).map_err(|err| SelectorError::Regex {
                        pattern: value.to_owned(),
                        reason: err.to_string().lines().last().unwrap_or("").to_owned(),
                    })?,
                )
            }
            MatchOp::Equal | MatchOp::NotEqual => None,
        };
        Ok(Matcher {
            name: name.to_owned(),
            op,
            value: value.to_owned(),
            regex,
        })
    }

    /// Whether a label value (`""` when the label is absent, as in PromQL) matches.
    pub fn matches(&self, value: &str) -> bool {
        match self.op {
            MatchOp::Equal => value == self.value,
            MatchOp::NotEqual => value != self.value,
            MatchOp::Regex => self.regex.as_ref().is_some_and(|r| r.is_match(value)),
            MatchOp::NotRegex => !self.regex.as_ref().is_some_and(|r| r.is_match(value)),
        }
    }
}

/// A conjunction of matchers; the empty selector `{}` matches everything.
#[derive(Clone, Debug, Default)]
pub struct Selector {
    pub matchers: Vec<Matcher>,
}

impl Selector {
    pub fn parse(text: &str) -> Result<Selector, SelectorError> {
        let syntax = |reason: &str| SelectorError::Syntax {
            selector: text.to_owned(),
            reason: reason.to_owned(),
        };
        if text.len() > MAX_SELECTOR_BYTES {
            return Err(SelectorError::TooLong { bytes: text.len() });
        }
        let trimmed = text.trim();
        if trimmed.is_empty() {
            return Ok(Selector::default());
        }
        let inner = trimmed
            .strip_prefix('{')
            .and_then(|rest| rest.strip_suffix('}'))
            .ok_or_else(|| syntax("expected `{name=\"value\", ...}`"))?;
        let mut chars = inner.chars().peekable();
        let mut matchers = Vec::new();
        loop {
            skip_spaces(&mut chars);
            if chars.peek().is_none() {
                break;
            }
            let name: String = take_while(&mut chars, |c| c.is_alphanumeric() || "_.".contains(c));
            let name = if name.is_empty() && chars.peek() == Some(&'"') {
                // Quoted label names (`{"otel.scope.name"="x"}`).
                read_quoted(&mut chars).map_err(syntax)?
            } else {
                name
            };
            if name.is_empty() {
                return Err(syntax("expected a label name"));
            }
            if matchers.len() == MAX_MATCHERS {
                return Err(SelectorError::TooManyMatchers);
            }
            skip_spaces(&mut chars);
            let op = match (chars.next(), chars.peek().copied()) {
                (Some('='), Some('~')) => {
                    chars.next();
                    MatchOp::Regex
                }
                (Some('='), _) => MatchOp::Equal,
                (Some('!'), Some('=')) => {
                    chars.next();
                    MatchOp::NotEqual
                }
                (Some('!'), Some('~')) => {
                    chars.next();
                    MatchOp::NotRegex
                }
                _ => return Err(syntax("expected one of =, !=, =~, !~ after a label name")),
            };
            skip_spaces(&mut chars);
            let value = read_quoted(&mut chars).map_err(syntax)?;
            matchers.push(Matcher::new(&name, op, &value)?);
            skip_spaces(&mut chars);
            match chars.next() {
                None => break,
                Some(',') => continue,
                Some(_) => return Err(syntax("expected `,` between matchers")),
            }
        }
        Ok(Selector { matchers })
    }

    /// Whether a label set (sorted or not) matches every matcher.
    pub fn matches(&self, labels: &[(String, String)]) -> bool {
        self.matchers.iter().all(|m| {
            let value = labels
                .iter()
                .find(|(k, _)| *k == m.name)
                .map_or("", |(_, v)| v.as_str());
            m.matches(value)
        })
    }
}

fn skip_spaces(chars: &mut std::iter::Peekable<std::str::Chars<'_>>) {
    while chars.peek().is_some_and(|c| c.is_whitespace()) {
        chars.next();
    }
}

fn take_while(
    chars: &mut std::iter::Peekable<std::str::Chars<'_>>,
    accept: impl Fn(char) -> bool,
) -> String {
    let mut out = String::new();
    while let Some(&c) = chars.peek() {
        if !accept(c) {
            break;
        }
        out.push(c);
        chars.next();
    }
    out
}

/// Reads a `"..."`, `'...'` or `` `...` `` string with Go-style backslash escapes (none in
/// backticks).
fn read_quoted(
    chars: &mut std::iter::Peekable<std::str::Chars<'_>>,
) -> Result<String, &'static str> {
    let quote = match chars.next() {
        Some(q @ ('"' | '\'' | '`')) => q,
        _ => return Err("expected a quoted value"),
    };
    let mut out = String::new();
    loop {
        match chars.next() {
            None => return Err("unterminated string"),
            Some(c) if c == quote => return Ok(out),
            Some('\\') if quote != '`' => match chars.next() {
                Some('n') => out.push('\n'),
                Some('t') => out.push('\t'),
                Some(c @ ('\\' | '"' | '\'')) => out.push(c),
                // Keep unknown escapes for the regex engine (`\d`, `\.`).
                Some(c) => {
                    out.push('\\');
                    out.push(c);
                }
                None => return Err("unterminated string"),
            },
            Some(c) => out.push(c),
        }
    }
}

/// Parses the legacy `/ingest` `name` parameter: `app{k1=v1,k2=v2}` into the application name
/// and its labels. Keys starting with `__` are dropped (as Pyroscope does), values may contain
/// anything but `,` and `}`.
pub fn parse_app_name(text: &str) -> Result<(String, Vec<(String, String)>), SelectorError> {
    let bad = |reason| SelectorError::AppName {
        name: text.to_owned(),
        reason,
    };
    let (app, rest) = match text.find('{') {
        Some(pos) => (&text[..pos], Some(&text[pos + 1..])),
        None => (text, None),
    };
    let app = app.trim();
    if app.is_empty() {
        return Err(bad("the application name is empty"));
    }
    if !app
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || "_.-/".contains(c))
    {
        return Err(bad(
            "the application name may only contain letters, digits and _ . - /",
        ));
    }
    let mut labels = Vec::new();
    if let Some(rest) = rest {
        let body = rest
            .trim_end()
            .strip_suffix('}')
            .ok_or(bad("missing closing `}`"))?;
        for pair in body.split(',') {
            if pair.trim().is_empty() {
                continue;
            }
            let (key, value) = pair
                .split_once('=')
                .ok_or(bad("labels must be key=value"))?;
            let (key, value) = (key.trim(), value.trim());
            if key.is_empty()
                || !key
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "_.".contains(c))
            {
                return Err(bad("label names may only contain letters, digits, _ and ."));
            }
            if value.contains('}') {
                return Err(bad("label values may not contain `}`"));
            }
            if key == "__name__" {
                return Err(bad("the label __name__ is reserved"));
            }
            if key.starts_with("__") && key != "__session_id__" {
                continue;
            }
            labels.push((key.to_owned(), value.to_owned()));
        }
    }
    Ok((app.to_owned(), labels))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn selectors_beyond_the_limits_are_refused() {
        let matchers = |n: usize| {
            let list: Vec<String> = (0..n).map(|i| format!("l{i}=\"v\"")).collect();
            format!("{{{}}}", list.join(","))
        };
        assert_eq!(
            Selector::parse(&matchers(MAX_MATCHERS))
                .unwrap()
                .matchers
                .len(),
            MAX_MATCHERS
        );
        let err = Selector::parse(&matchers(MAX_MATCHERS + 1)).unwrap_err();
        assert_eq!(err, SelectorError::TooManyMatchers);
        assert!(err.is_limit());
        assert_eq!(err.to_string(), "label selector has more than 64 matchers");
        let long = format!("{{a=\"{}\"}}", "x".repeat(MAX_SELECTOR_BYTES));
        let err = Selector::parse(&long).unwrap_err();
        assert!(matches!(err, SelectorError::TooLong { .. }), "{err}");
        assert!(!err.to_string().contains("xxx"), "{err}");
        assert!(!Selector::parse("{a=\"\"}").unwrap().matchers.is_empty());
        assert!(!Selector::parse("{a=}").unwrap_err().is_limit());
    }

    #[test]
    fn selectors_match_like_promql() {
        let set = labels(&[("service_name", "api"), ("env", "prod")]);
        let matches = |s: &str| Selector::parse(s).unwrap().matches(&set);
        assert!(matches("{}"));
        assert!(matches(""));
        assert!(matches(r#"{service_name="api"}"#));
        assert!(matches(r#"{ service_name = "api" , env=~"pro.*" }"#));
        assert!(!matches(r#"{service_name="api", env!="prod"}"#));
        assert!(matches(r#"{env!~"dev|test"}"#));
        assert!(!matches(r#"{env=~"pro"}"#), "regexes are anchored");
        assert!(matches(r#"{missing=""}"#), "absent label equals empty");
        assert!(matches(r#"{"service_name"='api'}"#));
    }

    #[test]
    fn bad_selectors_get_one_line_errors() {
        for bad in [
            "service_name=\"x\"",
            "{service_name}",
            "{service_name=x}",
            "{a=\"b\" c=\"d\"}",
            "{a=\"unterminated}",
            "{=\"x\"}",
        ] {
            let err = Selector::parse(bad).unwrap_err().to_string();
            assert!(err.starts_with("invalid label selector"), "{bad}: {err}");
            assert!(!err.contains('\n'));
        }
        let err = Selector::parse(r#"{a=~"("}"#).unwrap_err().to_string();
        assert!(err.contains("regular expression"), "{err}");
        assert!(!err.contains('\n'), "{err}");
    }

    #[test]
    fn app_names_parse_like_pyroscope() {
        assert_eq!(
            parse_app_name("my-app.cpu{env=dev, host = h1,__secret=x,__session_id__=ab}").unwrap(),
            (
                "my-app.cpu".to_owned(),
                labels(&[("env", "dev"), ("host", "h1"), ("__session_id__", "ab")])
            )
        );
        assert_eq!(parse_app_name("app").unwrap(), ("app".to_owned(), vec![]));
        assert_eq!(parse_app_name("app{}").unwrap(), ("app".to_owned(), vec![]));
        for bad in [
            "",
            "{a=b}",
            "my app",
            "app{a=b",
            "app{a}",
            "app{a b=c}",
            "app{__name__=x}",
        ] {
            assert!(parse_app_name(bad).is_err(), "{bad}");
        }
    }
}
