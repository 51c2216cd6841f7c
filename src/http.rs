//! The HTTP endpoint: `/metrics` for Prometheus, the health checks, and the admin action that
//! skips a bad record.

use crate::health::health;
use crate::metrics::metrics;
use inlet_common::error::ErrorKind;

/// Binds `listen`; the returned future serves `/metrics`, the health endpoints and the skip
/// request until the process ends: `/health/live` answers 200 while the process serves
/// requests; `/health/ready` (and `/health`) answers 200 when every readiness check passes,
/// else 503, with one line per check. Admin actions need `admin_token`, and are refused
/// without one.
pub async fn bind(
    listen: &str,
    admin_token: Option<String>,
) -> inlet_common::error::Result<impl std::future::Future<Output = inlet_common::error::Result<()>>>
{
    use axum::http::StatusCode;
    use axum::routing::{get, post};
    use inlet_common::error::ResultExt;
    let admin = std::sync::Arc::new(Admin { token: admin_token });
    let ready = || async {
        let report = health().report();
        let status = if report.ready {
            StatusCode::OK
        } else {
            StatusCode::SERVICE_UNAVAILABLE
        };
        (status, report.to_string())
    };
    let app = axum::Router::new()
        .route(
            "/metrics",
            get(|| async {
                health().report();
                metrics().render()
            }),
        )
        .route("/health/live", get(|| async { "ok\n" }))
        .route("/health/ready", get(ready))
        .route("/health", get(ready))
        .route(
            "/errors/skip",
            post(move |headers: axum::http::HeaderMap, uri| async move {
                use axum::response::IntoResponse;
                match admin.authorize(&headers) {
                    Ok(()) => skip(uri).await.into_response(),
                    Err(refused) => refused.into_response(),
                }
            }),
        );
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .or_kind(ErrorKind::Config, || {
            format!("metrics.listen: cannot bind {listen}; free the port or choose another address")
        })?;
    tracing::info!(listen, "Serving metrics and health");
    Ok(async move {
        axum::serve(listener, app)
            .await
            .or_kind(ErrorKind::Internal, || "metrics server stopped".into())
    })
}

/// Who may take admin actions on the metrics address, which Prometheus and every pod that can
/// scrape it reach: only a request bearing `metrics.admin_token`, and nobody when it is unset.
struct Admin {
    token: Option<String>,
}

impl Admin {
    /// `Ok` for `Authorization: Bearer <token>`, else why the request is refused.
    fn authorize(&self, headers: &axum::http::HeaderMap) -> Result<(), Refused> {
        let Some(token) = &self.token else {
            return Err(Refused::Off);
        };
        let presented = headers
            .get(axum::http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map(|(_, credentials)| credentials.trim());
        if presented.is_some_and(|p| constant_time_eq(token.as_bytes(), p.as_bytes())) {
            return Ok(());
        }
        tracing::warn!("Refused an admin request without the right bearer token");
        Err(Refused::Unauthorized)
    }
}

/// Why an admin request is refused.
#[derive(Debug)]
enum Refused {
    /// No `metrics.admin_token` is configured: 403.
    Off,
    /// The bearer token is missing or wrong: 401.
    Unauthorized,
}

impl axum::response::IntoResponse for Refused {
    fn into_response(self) -> axum::response::Response {
        use axum::http::{header, StatusCode};
        match self {
            Refused::Off => (
                StatusCode::FORBIDDEN,
                "admin actions are off: set metrics.admin_token (e.g. \"${file:/path}\") and send it as Authorization: Bearer <token>\n",
            )
                .into_response(),
            Refused::Unauthorized => (
                StatusCode::UNAUTHORIZED,
                [(header::WWW_AUTHENTICATE, "Bearer")],
                "send the token of metrics.admin_token as Authorization: Bearer <token>\n",
            )
                .into_response(),
        }
    }
}

/// Whether `secret` equals `presented`, in a time that depends only on `presented`'s length,
/// so response times do not reveal how much of a guess was right.
fn constant_time_eq(secret: &[u8], presented: &[u8]) -> bool {
    if secret.is_empty() {
        return false;
    }
    let mut diff = (secret.len() != presented.len()) as u8;
    for (i, b) in presented.iter().enumerate() {
        diff |= std::hint::black_box(secret[i % secret.len()] ^ b);
    }
    diff == 0
}

/// `POST /errors/skip?topic=T&partition=P&offset=O`: skips the bad record the pipeline is
/// stopped at; any other record is refused, so a request can only ever release that one.
async fn skip(uri: axum::http::Uri) -> (axum::http::StatusCode, String) {
    use axum::http::StatusCode;
    let mut at = (None, None, None);
    for pair in uri.query().unwrap_or("").split('&') {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        let v = percent_encoding::percent_decode_str(v)
            .decode_utf8_lossy()
            .into_owned();
        match k {
            "topic" => at.0 = Some(v),
            "partition" => at.1 = v.parse::<i32>().ok(),
            "offset" => at.2 = v.parse::<i64>().ok(),
            _ => {}
        }
    }
    let (Some(topic), Some(partition), Some(offset)) = at else {
        return (
            StatusCode::BAD_REQUEST,
            "name the record: ?topic=T&partition=P&offset=O\n".into(),
        );
    };
    let at = inlet_common::error::RecordAt {
        topic,
        partition,
        offset,
    };
    match health().request_skip(at.clone()) {
        Ok(()) => (
            StatusCode::OK,
            format!("skipping {at}; the pipeline restarts\n"),
        ),
        Err(why) => (StatusCode::CONFLICT, format!("{why}\n")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::{header, HeaderMap, StatusCode};
    use axum::response::IntoResponse;

    fn status(admin: &Admin, authorization: Option<&str>) -> StatusCode {
        let mut headers = HeaderMap::new();
        if let Some(a) = authorization {
            headers.insert(header::AUTHORIZATION, a.parse().unwrap());
        }
        match admin.authorize(&headers) {
            Ok(()) => StatusCode::OK,
            Err(r) => r.into_response().status(),
        }
    }

    #[test]
    fn admin_actions_need_the_configured_bearer_token() {
        let off = Admin { token: None };
        assert_eq!(status(&off, None), StatusCode::FORBIDDEN);
        assert_eq!(status(&off, Some("Bearer anything")), StatusCode::FORBIDDEN);

        let on = Admin {
            token: Some("s3cret-t0ken".into()),
        };
        assert_eq!(status(&on, None), StatusCode::UNAUTHORIZED);
        for wrong in [
            "Bearer s3cret-t0kem",
            "Bearer s3cret-t0ke",
            "Bearer s3cret-t0ken0",
            "Bearer ",
            "Basic s3cret-t0ken",
            "s3cret-t0ken",
        ] {
            assert_eq!(
                status(&on, Some(wrong)),
                StatusCode::UNAUTHORIZED,
                "{wrong}"
            );
        }
        assert_eq!(status(&on, Some("Bearer s3cret-t0ken")), StatusCode::OK);
        assert_eq!(status(&on, Some("bearer s3cret-t0ken")), StatusCode::OK);
    }

    #[test]
    fn token_comparison_needs_every_byte_and_the_length() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"ab"));
        assert!(!constant_time_eq(b"abc", b"abca"));
        assert!(!constant_time_eq(b"abc", b"abcabc"));
        assert!(!constant_time_eq(b"", b""));
    }
}
