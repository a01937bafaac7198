package audit

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"testing"
)

// FuzzVerify: the verifier never panics, and whatever it accepts has every
// entry's hash link intact (a line it passes cannot be an edited entry).
func FuzzVerify(f *testing.F) {
	// Seeds must be deterministic (the fuzz workers rebuild them), so no
	// encrypted seed: its nonce is random. Encryption changes only Data.
	for _, enc := range []bool{false, true} {
		var buf bytes.Buffer
		prev := ZeroHash
		var envs []Envelope
		for i := int64(1); i <= 3; i++ {
			data, _, err := EncodeEntry(Entry{OperationID: "op_f", Event: "polled", Story: "s", Used: int(i)}, nil)
			if err != nil {
				f.Fatal(err)
			}
			if enc {
				data = []byte(base64.StdEncoding.EncodeToString(data))
			}
			envs = append(envs, Seal(prev, i, "op_f", data, enc))
			prev = envs[len(envs)-1].Hash
		}
		if err := WriteExport(&buf, envs, NewHead("op_f", 3, prev)); err != nil {
			f.Fatal(err)
		}
		f.Add(buf.Bytes())
	}
	f.Add([]byte(`{"type":"head","operation_id":"x","count":0,"hash":"` + ZeroHash + `"}`))
	f.Add([]byte("{\n\n}"))
	f.Fuzz(func(t *testing.T, data []byte) {
		rep, err := Verify(bytes.NewReader(data))
		if err != nil {
			t.Fatalf("reading from memory failed: %v", err)
		}
		if rep.FirstBad != nil && rep.FirstBad.Line < 1 {
			t.Fatalf("problem without a line: %+v", rep.FirstBad)
		}
		if !rep.OK() {
			return
		}
		var envs []Envelope
		for _, line := range bytes.Split(data, []byte("\n")) {
			var l exportLine
			if len(bytes.TrimSpace(line)) == 0 || json.Unmarshal(line, &l) != nil || l.Type != "" {
				continue
			}
			if l.Data == nil || Hash(l.Prev, []byte(*l.Data)) != l.Hash {
				t.Fatalf("accepted an entry whose hash does not match: %s", line)
			}
			envs = append(envs, Envelope{})
		}
		if len(envs) != rep.Entries {
			t.Fatalf("report says %d entries, found %d", rep.Entries, len(envs))
		}
	})
}
