//! `samplerctl health`: the grpc.health.v1 Check RPC. Prints the status and
//! exits 0 when SERVING, 1 for any other status or when the server cannot
//! be reached.

use std::process::ExitCode;

use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;

use crate::cli::{ConnArgs, HealthArgs};
use crate::connect::connect;
use crate::output::{Style, emit, paint};

/// Runs the health check.
pub async fn run(conn: &ConnArgs, args: HealthArgs) -> anyhow::Result<ExitCode> {
    let c = connect(conn).await?;
    let resp = c
        .health()
        .check(HealthCheckRequest {
            service: args.service,
        })
        .await?
        .into_inner();
    let status = ServingStatus::try_from(resp.status).unwrap_or(ServingStatus::Unknown);
    let name = status.as_str_name();
    if status == ServingStatus::Serving {
        emit(&format!("{} ({})\n", paint(Style::Green, name), c.addr))?;
        Ok(ExitCode::SUCCESS)
    } else {
        emit(&format!("{} ({})\n", paint(Style::Red, name), c.addr))?;
        Ok(ExitCode::FAILURE)
    }
}
