//! What every request to the admin endpoint passes before its route: the `Host` it names must
//! be this endpoint (against DNS rebinding: a page on a name the attacker controls, resolved
//! to this machine, would otherwise read `/errors/messages` and post to ingest with the
//! browser's help), and a request that changes something must not come from another site
//! (against cross-site request forgery: a browser sends a cross-origin `text/plain` POST
//! without asking). Tools that are not browsers (curl, Prometheus, the CLI) send no `Origin`
//! and no `Sec-Fetch-Site` and pass the second check as they are.

use std::net::IpAddr;
use std::sync::OnceLock;

use axum::extract::{Request, State};
use axum::http::{HeaderMap, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::Response;

use super::{Shared, error};

/// The setting that names the host names the endpoint answers to.
const ALLOWED_HOSTS: &str = "admin.allowed_hosts";

/// Refuses a request whose `Host` is not this endpoint, or a cross-site request that changes
/// something; passes the rest to the route.
pub(super) async fn guard(State(host): State<Shared>, request: Request, next: Next) -> Response {
    let allowed = host.settings().allowed_hosts.clone();
    match refusal(
        request.method(),
        request.headers(),
        &allowed,
        machine_name(),
    ) {
        Some(why) => {
            tracing::warn!(method = %request.method(), path = %request.uri().path(), reason = %why,
                "admin request refused");
            error(StatusCode::FORBIDDEN, why)
        }
        None => next.run(request).await,
    }
}

/// This machine's host name, lowercase (read once).
fn machine_name() -> Option<&'static str> {
    static NAME: OnceLock<Option<String>> = OnceLock::new();
    NAME.get_or_init(|| {
        sysinfo::System::host_name()
            .ok()
            .map(|n| n.to_ascii_lowercase())
    })
    .as_deref()
}

/// Why a request is refused; None when it may go on.
fn refusal(
    method: &Method,
    headers: &HeaderMap,
    allowed: &[String],
    machine: Option<&str>,
) -> Option<String> {
    let host = headers.get(header::HOST).and_then(|h| h.to_str().ok());
    if let Some(host) = host
        && !host_is_allowed(host, allowed, machine)
    {
        return Some(format!(
            "Host `{}` is not this endpoint: it answers to IP addresses, localhost, this machine's name and the names in {ALLOWED_HOSTS}",
            printable(host)
        ));
    }
    if matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS) {
        return None;
    }
    let fetch_site = headers.get("sec-fetch-site").and_then(|v| v.to_str().ok());
    if let Some(site) = fetch_site
        && !matches!(site, "same-origin" | "none")
    {
        return Some(format!(
            "a {method} from another site (Sec-Fetch-Site: {}) is refused",
            printable(site)
        ));
    }
    let origin = headers
        .get(header::ORIGIN)
        .map(|v| v.to_str().unwrap_or(""));
    match (origin, host) {
        (None, _) => None,
        (Some(origin), Some(host)) if same_authority(origin, host) => None,
        (Some(origin), _) => Some(format!(
            "a {method} from origin `{}` is refused: only pages of this endpoint may change it",
            printable(origin)
        )),
    }
}

/// Whether `host` (a `Host` header: a name or an IP address, with or without a port) is one
/// this endpoint answers to.
fn host_is_allowed(host: &str, allowed: &[String], machine: Option<&str>) -> bool {
    let Ok(authority) = host.parse::<axum::http::uri::Authority>() else {
        return false;
    };
    let name = authority.host();
    if name
        .trim_start_matches('[')
        .trim_end_matches(']')
        .parse::<IpAddr>()
        .is_ok()
    {
        return true;
    }
    let name = name.to_ascii_lowercase();
    name == "localhost"
        || machine == Some(name.as_str())
        || allowed
            .iter()
            .any(|a| a == "*" || a.eq_ignore_ascii_case(&name))
}

/// Whether `origin` (`scheme://host[:port]`) names the same host and port as `host`.
fn same_authority(origin: &str, host: &str) -> bool {
    let Some((scheme, authority)) = origin.split_once("://") else {
        return false;
    };
    let default_port = match scheme {
        "http" => "80",
        "https" => "443",
        _ => return false,
    };
    let with_port = |a: &str| match a.rsplit_once(':') {
        Some((_, port)) if !a.ends_with(']') && port.chars().all(|c| c.is_ascii_digit()) => {
            a.to_ascii_lowercase()
        }
        _ => format!("{}:{default_port}", a.to_ascii_lowercase()),
    };
    with_port(authority) == with_port(host)
}

/// `text` with control characters shown as escapes, for messages and logs.
fn printable(text: &str) -> String {
    text.chars()
        .take(200)
        .flat_map(char::escape_debug)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        pairs
            .iter()
            .map(|(k, v)| (header::HeaderName::from_static(k), v.parse().unwrap()))
            .collect()
    }

    #[test]
    fn the_endpoint_answers_to_addresses_localhost_its_machine_and_listed_names() {
        let listed = vec!["throttle01.example".to_string()];
        for ok in [
            "127.0.0.1:9464",
            "[::1]:9464",
            "10.1.2.3",
            "localhost:9464",
            "LOCALHOST",
            "build-7:9464",
            "Throttle01.example:9464",
        ] {
            assert!(host_is_allowed(ok, &listed, Some("build-7")), "{ok}");
        }
        for refused in ["evil.example:9464", "127.0.0.1.evil.example", "", "a b"] {
            assert!(
                !host_is_allowed(refused, &listed, Some("build-7")),
                "{refused}"
            );
        }
        assert!(host_is_allowed("anything.example", &["*".into()], None));
    }

    #[test]
    fn a_cross_site_change_is_refused_and_a_same_site_one_or_a_tool_passes() {
        let (post, get) = (Method::POST, Method::GET);
        let host = ("host", "127.0.0.1:9464");
        let check =
            |m: &Method, h: &[(&'static str, &'static str)]| refusal(m, &headers(h), &[], None);
        assert_eq!(check(&post, &[host]), None, "curl, the CLI");
        assert_eq!(
            check(&post, &[host, ("origin", "http://127.0.0.1:9464")]),
            None,
            "the console"
        );
        assert!(check(&post, &[host, ("origin", "http://evil.example")]).is_some());
        assert!(check(&post, &[host, ("origin", "null")]).is_some());
        assert!(check(&post, &[host, ("origin", "http://127.0.0.1:9465")]).is_some());
        assert!(check(&post, &[host, ("sec-fetch-site", "cross-site")]).is_some());
        assert_eq!(
            check(&get, &[host, ("origin", "http://evil.example")]),
            None,
            "reads are guarded by the Host check alone"
        );
        let rebound = check(&get, &[("host", "evil.example:9464")]).unwrap();
        assert!(rebound.contains("admin.allowed_hosts"), "{rebound}");
        assert!(
            same_authority("http://localhost", "localhost:80"),
            "default ports"
        );
    }
}
