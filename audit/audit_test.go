package audit

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

var testKey = bytes.Repeat([]byte{7}, KeySize)

// chain builds an operation's envelopes the way the ledger does.
func chain(t *testing.T, opID string, n int, key []byte) ([]Envelope, Head) {
	t.Helper()
	prev := ZeroHash
	var envs []Envelope
	for i := 1; i <= n; i++ {
		e := Entry{Time: time.Date(2026, 1, 2, 10, 20, i, 0, time.UTC), OperationID: opID, Provider: "p",
			Event: "polled", Used: i, Max: 12, Story: "polled, state queued"}
		data, enc, err := EncodeEntry(e, key)
		if err != nil {
			t.Fatal(err)
		}
		env := Seal(prev, int64(i), opID, data, enc)
		envs = append(envs, env)
		prev = env.Hash
	}
	return envs, NewHead(opID, int64(n), prev)
}

func export(t *testing.T, key []byte) []string {
	t.Helper()
	var buf bytes.Buffer
	for _, id := range []string{"op_a", "op_b"} {
		envs, head := chain(t, id, 4, key)
		if err := WriteExport(&buf, envs, head); err != nil {
			t.Fatal(err)
		}
	}
	return strings.Split(strings.TrimSuffix(buf.String(), "\n"), "\n")
}

func verifyLines(t *testing.T, lines []string) Report {
	t.Helper()
	rep, err := Verify(strings.NewReader(strings.Join(lines, "\n") + "\n"))
	if err != nil {
		t.Fatal(err)
	}
	return rep
}

func TestSealHashChain(t *testing.T) {
	data := []byte(`{"event":"created"}`)
	env := Seal("", 1, "op", data, false)
	if env.Prev != ZeroHash {
		t.Fatalf("prev = %q, want ZeroHash", env.Prev)
	}
	zero := make([]byte, 32)
	want := sha256Hex(append(zero, data...))
	if env.Hash != want {
		t.Fatalf("hash = %s, want SHA-256(zero||data) = %s", env.Hash, want)
	}
	next := Seal(env.Hash, 2, "op", data, false)
	pb, _ := hex.DecodeString(env.Hash)
	if next.Hash != sha256Hex(append(pb, data...)) {
		t.Fatal("second hash is not SHA-256(prev bytes || data)")
	}
}

func TestEncodeDecode(t *testing.T) {
	e := Entry{Time: time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC), OperationID: "op_1", Provider: "p", Event: "polled", Used: 3, Max: 12, Story: "s"}
	for _, key := range [][]byte{nil, testKey} {
		data, enc, err := EncodeEntry(e, key)
		if err != nil {
			t.Fatal(err)
		}
		if enc != (key != nil) {
			t.Fatalf("encrypted = %v with key %v", enc, key != nil)
		}
		if enc && bytes.Contains(data, []byte("polled")) {
			t.Fatal("ciphertext contains plaintext")
		}
		env := Seal("", 1, "op_1", data, enc)
		got, err := DecodeEntry(env, key)
		if err != nil {
			t.Fatal(err)
		}
		if !got.Time.Equal(e.Time) || got.Event != e.Event || got.Used != 3 || got.OperationID != "op_1" {
			t.Fatalf("round trip: got %+v", got)
		}
		if enc {
			if _, err := DecodeEntry(env, nil); err == nil || !strings.Contains(err.Error(), "encrypted") {
				t.Fatalf("decode without key: %v", err)
			}
			if _, err := DecodeEntry(env, bytes.Repeat([]byte{8}, KeySize)); err == nil {
				t.Fatal("decode with the wrong key succeeded")
			}
			moved := env
			moved.OperationID = "op_2" // R26: an entry moved to another chain does not decrypt
			if _, err := DecodeEntry(moved, key); err == nil {
				t.Fatal("entry moved to another operation decrypted")
			}
		}
	}
	if _, _, err := EncodeEntry(e, []byte("short")); err == nil {
		t.Fatal("short key accepted")
	}
}

func TestLoadKey(t *testing.T) {
	dir := t.TempDir()
	write := func(name string, b []byte) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, b, 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	raw := write("raw", testKey)
	hx := write("hex", []byte(hex.EncodeToString(testKey)+"\n"))
	for _, p := range []string{raw, hx} {
		k, err := LoadKey(p)
		if err != nil || !bytes.Equal(k, testKey) {
			t.Fatalf("LoadKey(%s) = %x, %v", p, k, err)
		}
	}
	for name, b := range map[string][]byte{"short": []byte("abc"), "badhex": []byte(strings.Repeat("zz", 32)), "long": make([]byte, 33)} {
		_, err := LoadKey(write(name, b))
		if err == nil || !strings.Contains(err.Error(), "64 hex characters") {
			t.Errorf("LoadKey(%s): want a clear error, got %v", name, err)
		}
	}
	if _, err := LoadKey(filepath.Join(dir, "missing")); err == nil {
		t.Fatal("missing file accepted")
	}
}

func TestVerifyIntact(t *testing.T) {
	for _, key := range [][]byte{nil, testKey} {
		rep := verifyLines(t, export(t, key))
		if !rep.OK() || rep.Operations != 2 || rep.Entries != 8 {
			t.Fatalf("intact export (key %v): %+v %v", key != nil, rep, rep.FirstBad)
		}
	}
}

// R26: every kind of tampering is detected and the first bad line is named.
// Lines: 1-4 op_a entries, 5 op_a head, 6-9 op_b entries, 10 op_b head.
func TestVerifyTampering(t *testing.T) {
	for _, key := range [][]byte{nil, testKey} {
		lines := export(t, key)
		edit := func(i int) []string {
			out := append([]string(nil), lines...)
			var env Envelope
			if err := json.Unmarshal([]byte(out[i]), &env); err != nil {
				t.Fatal(err)
			}
			if env.Encrypted {
				env.Data = "A" + env.Data[1:]
				if env.Data == lines[i] {
					env.Data = "B" + env.Data[1:]
				}
			} else {
				env.Data = strings.Replace(env.Data, "queued", "failed", 1)
			}
			b, _ := json.Marshal(env)
			out[i] = string(b)
			return out
		}
		del := func(i int) []string { return append(append([]string(nil), lines[:i]...), lines[i+1:]...) }
		cases := []struct {
			name    string
			lines   []string
			line    int
			op      string
			seq     int64
			whyPart string
		}{
			{"edit", edit(1), 2, "op_a", 2, "edited"},
			{"edit last", edit(8), 9, "op_b", 4, "edited"},
			{"delete middle", del(2), 3, "op_a", 4, "missing"},
			{"delete first", del(5), 6, "op_b", 2, "missing"},
			{"insert duplicate", append(append(append([]string(nil), lines[:3]...), lines[1]), lines[3:]...), 4, "op_a", 2, "out of order"},
			{"insert foreign", append(append(append([]string(nil), lines[:7]...), lines[1]), lines[7:]...), 8, "op_a", 2, "after the operation's head"},
			{"reorder", func() []string {
				out := append([]string(nil), lines...)
				out[1], out[2] = out[2], out[1]
				return out
			}(), 2, "op_a", 3, "missing"},
			{"truncate chain", del(8), 9, "op_b", 4, "truncated"},
			{"truncate file", lines[:8], 8, "op_b", 3, "head missing"},
			{"drop head", del(4), 4, "op_a", 4, "head missing"},
			{"garbage", append(append(append([]string(nil), lines[:3]...), "{not json"), lines[4:]...), 4, "", 0, "JSON"},
		}
		for _, c := range cases {
			rep := verifyLines(t, c.lines)
			p := rep.FirstBad
			if p == nil {
				t.Errorf("%s (key %v): tampering not detected", c.name, key != nil)
				continue
			}
			if p.Line != c.line || p.OperationID != c.op || p.Seq != c.seq || !strings.Contains(p.Why, c.whyPart) {
				t.Errorf("%s (key %v): got %s (seq %d), want line %d op %s seq %d containing %q", c.name, key != nil, p, p.Seq, c.line, c.op, c.seq, c.whyPart)
			}
		}
	}
}

func sha256Hex(b []byte) string {
	s := sha256.Sum256(b)
	return hex.EncodeToString(s[:])
}

// A line of an unknown type opens no chain that could lack its head at
// line 0: every problem names a real line.
func TestVerifyUnknownTypeLine(t *testing.T) {
	rep := verifyLines(t, []string{`{"type":"foo","operation_id":"x"}`})
	if rep.FirstBad == nil || rep.FirstBad.Line != 1 {
		t.Fatalf("got %+v, want a problem on line 1", rep.FirstBad)
	}
}
