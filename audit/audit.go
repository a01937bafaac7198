// Package audit owns the format of pollgate's tamper-evident audit log (R25,
// R26): the decision entry, the sealed envelope that is stored and exported,
// the hash chain that links envelopes per operation, optional AES-GCM
// encryption of entry contents, and the offline verifier.
//
// The chain is per operation: hash_n = SHA-256(hash_{n-1} || data_n), where
// data_n are the exact stored bytes of entry n (JSON, or ciphertext when
// encrypted) and hash_0 is 32 zero bytes. Verification therefore never needs
// the decryption key. audit does no I/O beyond the readers and writers it is
// given.
package audit

import "time"

// Entry is one decision in the story of an operation (R25).
type Entry struct {
	Time        time.Time `json:"time"`
	OperationID string    `json:"operation_id"`
	Provider    string    `json:"provider"`
	JobID       string    `json:"provider_job_id,omitempty"`
	// Event is what happened: "created", "polled", "early_poll", "escalated",
	// "extended", "closed", "action", "resubmission_allowed", "lease_expired", ...
	Event       string    `json:"event"`
	Decision    string    `json:"decision,omitempty"` // rules.Action or proxy decision
	State       string    `json:"state,omitempty"`
	HTTPStatus  int       `json:"http_status,omitempty"`
	NextPollAt  time.Time `json:"next_poll_at,omitzero"`
	DelaySource string    `json:"delay_source,omitempty"`
	Used        int       `json:"status_requests_used"`
	Max         int       `json:"status_requests_max"`
	EarlyPolls  int       `json:"early_polls,omitempty"` // early polls answered by pollgate so far (R7)
	DeadlineAt  time.Time `json:"deadline_at,omitzero"`
	Reason      string    `json:"reason,omitempty"`
	Actor       string    `json:"actor,omitempty"` // who, for admin steps
	Story       string    `json:"story"`           // the human line, e.g. "polled, state queued, next poll 10:20:14 from local backoff"
}

// Envelope is the stored and exported form of one entry (one JSONL line).
type Envelope struct {
	OperationID string `json:"operation_id"`
	Seq         int64  `json:"seq"`  // 1-based position in the operation's chain
	Prev        string `json:"prev"` // hex hash of the previous envelope (64 zeros for seq 1)
	Hash        string `json:"hash"` // hex SHA-256(prev bytes || Data bytes)
	// Data holds the entry's stored bytes: the Entry as JSON, or, when
	// Encrypted, base64 of nonce||AES-GCM ciphertext.
	Data      string `json:"data"`
	Encrypted bool   `json:"encrypted,omitempty"`
}

// Head is the exported chain head of one operation; the verifier uses it to
// detect truncation (entries removed from the end).
type Head struct {
	Type        string `json:"type"` // always "head"
	OperationID string `json:"operation_id"`
	Count       int64  `json:"count"`
	Hash        string `json:"hash"`
}

// ZeroHash is the "previous hash" of the first entry of every chain.
const ZeroHash = "0000000000000000000000000000000000000000000000000000000000000000"
