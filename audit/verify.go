package audit

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
)

// HeadType is the Type of a Head line in an export.
const HeadType = "head"

// Report is the result of Verify.
type Report struct {
	Operations int      // distinct operations seen
	Entries    int      // envelope lines read
	FirstBad   *Problem // nil when every chain is intact
}

// OK reports whether no problem was found.
func (r Report) OK() bool { return r.FirstBad == nil }

// Problem names the first bad line of an export.
type Problem struct {
	Line        int    // 1-based line of the export
	OperationID string // "" when the line could not be read
	Seq         int64  // the entry position that is bad or missing (0 if unknown)
	Why         string
}

func (p *Problem) String() string {
	if p.OperationID == "" {
		return fmt.Sprintf("line %d: %s", p.Line, p.Why)
	}
	return fmt.Sprintf("line %d: operation %s entry %d: %s", p.Line, p.OperationID, p.Seq, p.Why)
}

// exportLine is the union of Envelope and Head as they appear in an export.
type exportLine struct {
	Type        string  `json:"type"`
	OperationID string  `json:"operation_id"`
	Seq         int64   `json:"seq"`
	Prev        string  `json:"prev"`
	Hash        string  `json:"hash"`
	Data        *string `json:"data"`
	Encrypted   bool    `json:"encrypted"`
	Count       int64   `json:"count"`
}

type chainState struct {
	next     int64  // expected seq of the next entry
	prev     string // hash of the last entry
	lastLine int    // line of the last entry
	headSeen bool
}

// Verify reads an export (JSONL of Envelope lines, each operation's chain
// followed by its Head line, as written by WriteExport) and checks every
// chain: sequence numbers, prev links, hashes and the head's count and hash.
// It detects an edited, deleted, inserted or reordered entry and a truncated
// chain, and names the first bad line in Report.FirstBad. It needs no key:
// hashes cover the stored bytes, ciphertext included. The error is non-nil
// only when r cannot be read.
func Verify(r io.Reader) (Report, error) {
	var rep Report
	chains := map[string]*chainState{}
	var order []string
	note := func(p Problem) {
		if rep.FirstBad == nil || p.Line < rep.FirstBad.Line {
			rep.FirstBad = &p
		}
	}
	br := bufio.NewReader(r)
	line := 0
	for {
		raw, err := br.ReadBytes('\n')
		if len(raw) > 0 {
			line++
			verifyLine(line, raw, &rep, chains, &order, note)
		}
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return rep, fmt.Errorf("failed to read audit export: %w", err)
		}
	}
	for _, id := range order {
		st := chains[id]
		if !st.headSeen {
			note(Problem{Line: st.lastLine, OperationID: id, Seq: st.next - 1,
				Why: "chain head missing: the export ends without this operation's head line (truncated?)"})
		}
	}
	rep.Operations = len(order)
	return rep, nil
}

func verifyLine(line int, raw []byte, rep *Report, chains map[string]*chainState, order *[]string, note func(Problem)) {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 {
		return
	}
	var l exportLine
	if err := json.Unmarshal(raw, &l); err != nil {
		note(Problem{Line: line, Why: "not a valid JSON line: " + err.Error()})
		return
	}
	if l.OperationID == "" {
		note(Problem{Line: line, Why: "line has no operation_id"})
		return
	}
	st := chains[l.OperationID]
	if st == nil {
		st = &chainState{next: 1, prev: ZeroHash, lastLine: line}
		chains[l.OperationID] = st
		*order = append(*order, l.OperationID)
	}
	switch l.Type {
	case HeadType:
		switch {
		case st.headSeen:
			note(Problem{Line: line, OperationID: l.OperationID, Seq: l.Count, Why: "second head line for this operation"})
		case l.Count != st.next-1:
			seq := st.next
			if l.Count < st.next-1 {
				seq = l.Count + 1
			}
			note(Problem{Line: line, OperationID: l.OperationID, Seq: seq,
				Why: fmt.Sprintf("chain truncated or extended: head says %d entries, export has %d", l.Count, st.next-1)})
		case l.Hash != st.prev:
			note(Problem{Line: line, OperationID: l.OperationID, Seq: l.Count,
				Why: "head hash does not match the last entry"})
		}
		st.headSeen = true
		return
	case "":
	default:
		note(Problem{Line: line, OperationID: l.OperationID, Why: fmt.Sprintf("unknown line type %q", l.Type)})
		return
	}

	rep.Entries++
	st.lastLine = line
	switch {
	case st.headSeen:
		note(Problem{Line: line, OperationID: l.OperationID, Seq: l.Seq, Why: "entry after the operation's head line (inserted?)"})
	case l.Data == nil:
		note(Problem{Line: line, OperationID: l.OperationID, Seq: l.Seq, Why: "entry has no data"})
	case l.Seq < st.next:
		note(Problem{Line: line, OperationID: l.OperationID, Seq: l.Seq,
			Why: fmt.Sprintf("entry out of order or duplicated: seq %d after %d", l.Seq, st.next-1)})
	case l.Seq > st.next:
		note(Problem{Line: line, OperationID: l.OperationID, Seq: l.Seq,
			Why: fmt.Sprintf("entries missing before this one: want seq %d, got %d (deleted?)", st.next, l.Seq)})
	case l.Prev != st.prev:
		note(Problem{Line: line, OperationID: l.OperationID, Seq: l.Seq,
			Why: "prev does not match the previous entry's hash (entry deleted, inserted or reordered)"})
	case Hash(l.Prev, []byte(*l.Data)) != l.Hash:
		note(Problem{Line: line, OperationID: l.OperationID, Seq: l.Seq,
			Why: "hash does not match the entry's data (entry edited)"})
	}
	st.next = l.Seq + 1
	st.prev = l.Hash
}

// NewHead returns the head line for a chain of count entries ending in hash.
func NewHead(opID string, count int64, hash string) Head {
	if hash == "" {
		hash = ZeroHash
	}
	return Head{Type: HeadType, OperationID: opID, Count: count, Hash: hash}
}

// WriteExport writes one operation's envelopes, in chain order, followed by
// its head line, as JSONL. Export of a whole ledger calls it per operation.
func WriteExport(w io.Writer, envs []Envelope, head Head) error {
	head.Type = HeadType
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	for _, e := range envs {
		if err := enc.Encode(e); err != nil {
			return fmt.Errorf("failed to encode audit entry: %w", err)
		}
	}
	if err := enc.Encode(head); err != nil {
		return fmt.Errorf("failed to encode audit head: %w", err)
	}
	if _, err := w.Write(buf.Bytes()); err != nil {
		return fmt.Errorf("failed to write audit export: %w", err)
	}
	return nil
}
