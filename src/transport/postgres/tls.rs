//! TLS for PostgreSQL connections, with libpq's `sslmode` meanings, on rustls.
//!
//! - `disable`: plain text; no TLS connector is built at all.
//! - `prefer` (the default) and `require`: encrypted when the server offers TLS (`require`
//!   refuses a server that does not), the certificate not checked, as libpq does. No
//!   certificate store is loaded, so these modes start as fast as `disable`: OpenSSL parsed
//!   the system's whole CA bundle (twice, through native-tls) at every start, 50-60 ms of a
//!   100 ms start-up.
//! - `verify-ca`: the certificate chain is checked against `sslrootcert` (a PEM file) or,
//!   without it, the system's CA certificates; `verify-full` checks the host name too.
//!   `require` with `sslrootcert` checks the chain, as libpq does.
//!
//! tokio-postgres knows `disable`, `prefer` and `require` and no `sslrootcert`; this module
//! reads the rest out of the connection string before tokio-postgres parses it.

use std::sync::Arc;

use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{CryptoProvider, verify_tls12_signature, verify_tls13_signature};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{
    CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme,
};
use tokio_postgres_rustls::MakeRustlsConnect;

/// What of the server's certificate a connection checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Verify {
    /// Nothing (`prefer`, `require`).
    Nothing,
    /// That a trusted CA issued it (`verify-ca`).
    Chain,
    /// That, and that it names the host connected to (`verify-full`).
    ChainAndName,
}

/// What a connection string asks of TLS beyond what tokio-postgres reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct TlsSettings {
    /// The connection string as tokio-postgres accepts it (`verify-*` as `require`, no
    /// `sslrootcert`).
    pub connection_string: String,
    /// What of the server's certificate is checked.
    pub verify: Verify,
    /// The CA certificates to check it against (`sslrootcert`); the system's when absent.
    pub root_cert: Option<String>,
}

impl TlsSettings {
    /// Reads `sslmode` and `sslrootcert` from a libpq key=value or URL connection string.
    pub(super) fn read(raw: &str) -> TlsSettings {
        let (mut out, root_cert) = take_parameter(raw, "sslrootcert");
        let mut verify = Verify::Nothing;
        for (mode, checks) in [
            ("verify-full", Verify::ChainAndName),
            ("verify-ca", Verify::Chain),
        ] {
            let key = format!("sslmode={mode}");
            if out.contains(&key) {
                verify = checks;
                out = out.replace(&key, "sslmode=require");
            }
        }
        // libpq: `require` with a root certificate file checks the chain, as `verify-ca`.
        if verify == Verify::Nothing && root_cert.is_some() && out.contains("sslmode=require") {
            verify = Verify::Chain;
        }
        TlsSettings {
            connection_string: out,
            verify,
            root_cert,
        }
    }

    /// The rustls connector for these settings.
    pub(super) fn connector(&self) -> Result<MakeRustlsConnect, String> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| format!("cannot set up TLS: {e}"))?;
        let config = match self.verify {
            Verify::ChainAndName => builder
                .with_root_certificates(self.root_store()?)
                .with_no_client_auth(),
            Verify::Chain => {
                let chain = WebPkiServerVerifier::builder_with_provider(
                    Arc::new(self.root_store()?),
                    provider,
                )
                .build()
                .map_err(|e| format!("cannot set up TLS: {e}"))?;
                builder
                    .dangerous()
                    .with_custom_certificate_verifier(Arc::new(ChainOnly(chain)))
                    .with_no_client_auth()
            }
            Verify::Nothing => builder
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(AnyCertificate(provider)))
                .with_no_client_auth(),
        };
        Ok(MakeRustlsConnect::new(config))
    }

    /// The CA certificates a verifying mode checks against.
    fn root_store(&self) -> Result<RootCertStore, String> {
        let mut store = RootCertStore::empty();
        match &self.root_cert {
            Some(path) => {
                let certs = CertificateDer::pem_file_iter(path)
                    .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
                    .map_err(|e| {
                        format!("sslrootcert `{path}` is not a readable PEM certificate file: {e}")
                    })?;
                let (added, _) = store.add_parsable_certificates(certs);
                if added == 0 {
                    return Err(format!("sslrootcert `{path}` holds no CA certificate"));
                }
            }
            None => {
                let found = rustls_native_certs::load_native_certs();
                store.add_parsable_certificates(found.certs);
                if store.is_empty() {
                    return Err(format!(
                        "sslmode verify-ca/verify-full found no CA certificates on this system ({}); name a PEM file with sslrootcert",
                        found
                            .errors
                            .first()
                            .map(|e| e.to_string())
                            .unwrap_or_else(|| "none installed".into())
                    ));
                }
            }
        }
        Ok(store)
    }
}

/// Takes `key=value` out of a connection string (URL query or libpq key=value form); returns
/// the rest and the value (percent-decoded in a URL, unquoted in key=value form).
fn take_parameter(raw: &str, key: &str) -> (String, Option<String>) {
    let prefix = format!("{key}=");
    if !raw.contains(&prefix) {
        return (raw.to_string(), None);
    }
    if raw.starts_with("postgres://") || raw.starts_with("postgresql://") {
        let Some((base, query)) = raw.split_once('?') else {
            return (raw.to_string(), None);
        };
        let mut value = None;
        let rest: Vec<&str> = query
            .split('&')
            .filter(|pair| match pair.strip_prefix(&prefix) {
                Some(v) => {
                    value = Some(percent_decode(v));
                    false
                }
                None => true,
            })
            .collect();
        let out = if rest.is_empty() {
            base.to_string()
        } else {
            format!("{base}?{}", rest.join("&"))
        };
        return (out, value);
    }
    let mut value = None;
    let mut kept = Vec::new();
    let mut words = raw.split_whitespace().peekable();
    while let Some(word) = words.next() {
        match word.strip_prefix(&prefix) {
            Some(v) if v.starts_with('\'') => {
                // A quoted value may hold spaces: read to the closing quote.
                let mut quoted = v[1..].to_string();
                while !quoted.ends_with('\'') {
                    match words.next() {
                        Some(next) => {
                            quoted.push(' ');
                            quoted.push_str(next);
                        }
                        None => break,
                    }
                }
                value = Some(quoted.trim_end_matches('\'').to_string());
            }
            Some(v) => value = Some(v.to_string()),
            None => kept.push(word),
        }
    }
    (kept.join(" "), value)
}

/// Decodes `%xx` escapes (a path in a URL's query).
fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let escaped = (bytes[i] == b'%')
            .then(|| text.get(i + 1..i + 3))
            .flatten()
            .and_then(|hex| u8::from_str_radix(hex, 16).ok());
        match escaped {
            Some(b) => {
                out.push(b);
                i += 3;
            }
            None => {
                out.push(bytes[i]);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// `prefer` / `require`: any certificate is accepted (libpq does not check it in these modes),
/// but the handshake's signatures are still verified, so the session is encrypted to whoever
/// holds the certificate's key.
#[derive(Debug)]
struct AnyCertificate(Arc<CryptoProvider>);

impl ServerCertVerifier for AnyCertificate {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// `verify-ca`: the chain is checked as `verify-full` checks it, the name is not. rustls checks
/// the chain first and the name last, so a name error means the chain passed.
#[derive(Debug)]
struct ChainOnly(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
        {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verify_modes_become_require_and_ask_for_checks() {
        for (mode, checks) in [
            ("verify-ca", Verify::Chain),
            ("verify-full", Verify::ChainAndName),
        ] {
            let s = TlsSettings::read(&format!("host=db sslmode={mode} user=u"));
            assert_eq!(s.connection_string, "host=db sslmode=require user=u");
            assert_eq!(s.verify, checks, "{mode}");
        }
        let s = TlsSettings::read("postgres://u@db/test?sslmode=prefer");
        assert_eq!(s.verify, Verify::Nothing);
        assert_eq!(s.connection_string, "postgres://u@db/test?sslmode=prefer");
        // As libpq: `require` with a root file checks the chain; `prefer` does not.
        let s = TlsSettings::read("host=db sslmode=require sslrootcert=/ca.pem");
        assert_eq!(s.verify, Verify::Chain);
        let s = TlsSettings::read("host=db sslmode=prefer sslrootcert=/ca.pem");
        assert_eq!(s.verify, Verify::Nothing);
        assert_eq!(s.connection_string, "host=db sslmode=prefer");
    }

    #[test]
    fn sslrootcert_is_taken_out_of_urls_and_key_value_strings() {
        let s = TlsSettings::read(
            "postgres://u@db/test?sslrootcert=%2Fetc%2Fca%20dir%2Froot.pem&sslmode=verify-full",
        );
        assert_eq!(s.root_cert.as_deref(), Some("/etc/ca dir/root.pem"));
        assert_eq!(s.connection_string, "postgres://u@db/test?sslmode=require");
        let s = TlsSettings::read("postgres://u@db/test?sslrootcert=/ca.pem");
        assert_eq!(s.connection_string, "postgres://u@db/test");
        let s = TlsSettings::read("host=db sslrootcert='/etc/ca dir/root.pem' user=u");
        assert_eq!(s.root_cert.as_deref(), Some("/etc/ca dir/root.pem"));
        assert_eq!(s.connection_string, "host=db user=u");
        let s = TlsSettings::read("host=db sslrootcert=/ca.pem");
        assert_eq!(s.root_cert.as_deref(), Some("/ca.pem"));
        assert_eq!(s.connection_string, "host=db");
    }

    #[test]
    fn a_missing_root_cert_file_is_an_error_naming_it() {
        let s = TlsSettings::read("host=db sslmode=verify-full sslrootcert=/nonexistent/ca.pem");
        let e = s.connector().err().expect("an error");
        assert!(e.contains("sslrootcert `/nonexistent/ca.pem`"), "{e}");
    }

    #[test]
    fn prefer_builds_a_connector_without_a_certificate_store() {
        TlsSettings::read("host=db")
            .connector()
            .expect("a connector");
    }
}
