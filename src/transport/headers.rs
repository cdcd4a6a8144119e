//! The headers column: a JSON object of string -> string or null, written byte for byte as
//! the NServiceBus SQL transports write it (their `DictionarySerializer`): `/` escaped as
//! `\/`, characters outside the Basic Multilingual Plane as surrogate-pair escapes
//! (`\uD83D\uDE80`), other non-ASCII characters raw, control characters escaped. Parsing is
//! plain JSON and accepts both escaped and unescaped forms.

use std::fmt::Write;

use crate::message::Headers;

/// Writes headers in the NServiceBus wire form.
pub fn serialize_headers(headers: &Headers) -> String {
    let mut out = String::with_capacity(64 + headers.len() * 48);
    out.push('{');
    for (i, (key, value)) in headers.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        write_json_string(&mut out, key);
        out.push(':');
        match value {
            Some(v) => write_json_string(&mut out, v),
            None => out.push_str("null"),
        }
    }
    out.push('}');
    out
}

fn write_json_string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '/' => out.push_str("\\/"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04X}", c as u32);
            }
            c if (c as u32) > 0xFFFF => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{:04X}", unit);
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Parses the headers column. Any error makes the row a poison message.
pub fn parse_headers(text: &str) -> Result<Headers, String> {
    serde_json::from_str::<Headers>(text)
        .map_err(|e| format!("headers are not a JSON object of strings: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(key: &str, value: Option<&str>) -> Headers {
        let mut h = Headers::new();
        h.insert(key.into(), value.map(Into::into));
        h
    }

    #[test]
    fn slashes_are_escaped_like_datacontractjsonserializer() {
        assert_eq!(
            serialize_headers(&one("key/with/slashes", Some("a/b"))),
            r#"{"key\/with\/slashes":"a\/b"}"#
        );
    }

    #[test]
    fn supplementary_characters_become_surrogate_pairs_bmp_stays_raw() {
        assert_eq!(
            serialize_headers(&one("rocket", Some("\u{1F680} é ü 中"))),
            r#"{"rocket":"\uD83D\uDE80 é ü 中"}"#
        );
    }

    #[test]
    fn control_characters_and_nulls() {
        assert_eq!(
            serialize_headers(&one("k", Some("a\r\n\tb\u{1}"))),
            r#"{"k":"a\r\n\tb\u0001"}"#
        );
        assert_eq!(
            serialize_headers(&one("HelpLink", None)),
            r#"{"HelpLink":null}"#
        );
    }

    #[test]
    fn parsing_accepts_both_escaped_and_plain_forms() {
        let escaped = r#"{"a\/b":"\uD83D\uDE80","n":null}"#;
        let plain = "{\"a/b\":\"\u{1F680}\",\"n\":null}";
        assert_eq!(
            parse_headers(escaped).unwrap(),
            parse_headers(plain).unwrap()
        );
        let h = parse_headers(escaped).unwrap();
        assert_eq!(h["a/b"].as_deref(), Some("\u{1F680}"));
        assert_eq!(h["n"], None);
    }

    #[test]
    fn round_trip_is_lossless() {
        let mut h = Headers::new();
        h.insert("NServiceBus.MessageId".into(), Some("1/2\"3\\".into()));
        h.insert("x".into(), Some("\u{10FFFF}\u{7f}".into()));
        h.insert("n".into(), None);
        assert_eq!(parse_headers(&serialize_headers(&h)).unwrap(), h);
    }

    proptest::proptest! {
        #[test]
        fn any_headers_round_trip_with_slashes_and_non_bmp_escaped(
            map in proptest::collection::btree_map(".{0,12}", proptest::option::of(".{0,40}"), 0..8)
        ) {
            let headers: Headers = map;
            let wire = serialize_headers(&headers);
            proptest::prop_assert_eq!(parse_headers(&wire).unwrap(), headers);
            proptest::prop_assert!(wire.chars().all(|c| (c as u32) <= 0xFFFF), "non-BMP written as escapes");
            proptest::prop_assert!(!wire.contains('/') || wire.matches('/').count() == wire.matches("\\/").count());
        }
    }

    #[test]
    fn non_objects_and_non_string_values_are_errors() {
        assert!(parse_headers("[1]").is_err());
        assert!(parse_headers(r#"{"a":1}"#).is_err());
        assert!(parse_headers("{not json").is_err());
    }
}
