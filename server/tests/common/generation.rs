//! Collecting a whole Generate stream, bounded in time.

use std::time::Duration;

use samplerd_api::v1;
use samplerd_api::v1::generate_response::Event;

use super::TestServer;

/// Everything one Generate call streamed.
#[derive(Debug, Default, PartialEq)]
pub struct Output {
    pub tokens: Vec<u32>,
    /// Each token's log-probability, as bits (equal means bit for bit).
    pub logprob_bits: Vec<u32>,
    pub texts: Vec<String>,
    pub finished: Option<v1::Finished>,
    /// The `PromptLogprobs` event, which must come before any token.
    pub prompt_logprobs: Option<v1::PromptLogprobs>,
}

impl Output {
    pub fn text(&self) -> String {
        let mut t = self.texts.concat();
        if let Some(f) = &self.finished {
            t.push_str(&f.text);
        }
        t
    }

    pub fn reason(&self) -> v1::FinishReason {
        v1::FinishReason::try_from(self.finished.as_ref().unwrap().finish_reason).unwrap()
    }
}

pub const DEADLINE: Duration = Duration::from_secs(120);

pub async fn generate(s: &TestServer, req: v1::GenerateRequest) -> Result<Output, tonic::Status> {
    let mut client = s.client.clone();
    tokio::time::timeout(DEADLINE, async move {
        let mut stream = client.generate(req).await?.into_inner();
        let mut out = Output::default();
        while let Some(msg) = stream.message().await? {
            match msg.event.expect("event set") {
                Event::Token(t) => {
                    assert!(out.finished.is_none(), "token after Finished");
                    out.tokens.push(t.token_id);
                    out.logprob_bits.push(t.logprob.to_bits());
                    out.texts.push(t.text);
                }
                Event::Finished(f) => {
                    assert!(out.finished.is_none(), "two Finished messages");
                    out.finished = Some(f);
                }
                Event::PromptLogprobs(p) => {
                    assert!(
                        out.tokens.is_empty() && out.prompt_logprobs.is_none(),
                        "PromptLogprobs once, before the first token"
                    );
                    out.prompt_logprobs = Some(p);
                }
            }
        }
        assert!(out.finished.is_some(), "stream ended without Finished");
        Ok(out)
    })
    .await
    .expect("Generate finished within the deadline")
}

/// `f` without what depends on the run rather than the request: the
/// timings, and how much of the prompt the prompt cache supplied (the
/// output is the same bits either way), so two runs' messages compare
/// byte for byte.
pub fn without_run_details(f: &mut v1::Finished) {
    f.timings = None;
    if let Some(u) = &mut f.usage {
        u.cached_prompt_tokens = 0;
    }
}

/// Every choice of a Generate with `n` choices, by `choice`: each gets its
/// tokens before its one Finished, and every choice ends.
pub async fn generate_choices(
    s: &TestServer,
    req: v1::GenerateRequest,
) -> Result<Vec<Output>, tonic::Status> {
    let n = req.n.max(1) as usize;
    let mut client = s.client.clone();
    tokio::time::timeout(DEADLINE, async move {
        let mut stream = client.generate(req).await?.into_inner();
        let mut outs: Vec<Output> = (0..n).map(|_| Output::default()).collect();
        while let Some(msg) = stream.message().await? {
            match msg.event.expect("event set") {
                Event::Token(t) => {
                    let out = &mut outs[t.choice as usize];
                    assert!(
                        out.finished.is_none(),
                        "choice {}: token after Finished",
                        t.choice
                    );
                    out.tokens.push(t.token_id);
                    out.logprob_bits.push(t.logprob.to_bits());
                    out.texts.push(t.text);
                }
                Event::PromptLogprobs(p) => {
                    assert!(
                        outs.iter()
                            .all(|o| o.tokens.is_empty() && o.prompt_logprobs.is_none()),
                        "PromptLogprobs once, before any choice's first token"
                    );
                    outs[0].prompt_logprobs = Some(p);
                }
                Event::Finished(f) => {
                    let out = &mut outs[f.choice as usize];
                    assert!(out.finished.is_none(), "choice {}: two Finished", f.choice);
                    out.finished = Some(f);
                }
            }
        }
        for (i, out) in outs.iter().enumerate() {
            assert!(out.finished.is_some(), "choice {i} ended without Finished");
        }
        Ok(outs)
    })
    .await
    .expect("Generate finished within the deadline")
}
