package audit

import (
	"bytes"
	"crypto/aes"
	"crypto/cipher"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
)

// KeySize is the length of an audit encryption key (AES-256).
const KeySize = 32

// aadPrefix binds a ciphertext to the operation it belongs to: an encrypted
// entry moved into another operation's chain fails to decrypt.
const aadPrefix = "pollgate-audit-v1\x00"

// Hash returns hex(SHA-256(prevBytes || data)), the chain link of one entry.
// prev is the hex hash of the previous envelope ("" means ZeroHash). A prev
// that is not valid hex is hashed as its text, so a tampered prev never
// matches a hash computed over the real bytes.
func Hash(prev string, data []byte) string {
	if prev == "" {
		prev = ZeroHash
	}
	pb, err := hex.DecodeString(prev)
	if err != nil {
		pb = []byte(prev)
	}
	h := sha256.New()
	h.Write(pb)
	h.Write(data)
	return hex.EncodeToString(h.Sum(nil))
}

// Seal links data into an operation's chain after prev (the current chain
// head; "" or ZeroHash for the first entry) at position seq (1-based).
func Seal(prev string, seq int64, opID string, data []byte, encrypted bool) Envelope {
	if prev == "" {
		prev = ZeroHash
	}
	return Envelope{
		OperationID: opID,
		Seq:         seq,
		Prev:        prev,
		Hash:        Hash(prev, data),
		Data:        string(data),
		Encrypted:   encrypted,
	}
}

// EncodeEntry returns the bytes stored for e: its JSON, or, when key is not
// nil, base64(nonce || AES-256-GCM(JSON)) with the operation id as
// additional data. key must be KeySize bytes.
func EncodeEntry(e Entry, key []byte) (data []byte, encrypted bool, err error) {
	plain, err := json.Marshal(e)
	if err != nil {
		return nil, false, fmt.Errorf("failed to encode audit entry: %w", err)
	}
	if key == nil {
		return plain, false, nil
	}
	aead, err := newAEAD(key)
	if err != nil {
		return nil, false, err
	}
	nonce := make([]byte, aead.NonceSize(), aead.NonceSize()+len(plain)+aead.Overhead())
	if _, err := rand.Read(nonce); err != nil {
		return nil, false, fmt.Errorf("failed to read a nonce: %w", err)
	}
	sealed := aead.Seal(nonce, nonce, plain, []byte(aadPrefix+e.OperationID))
	out := make([]byte, base64.StdEncoding.EncodedLen(len(sealed)))
	base64.StdEncoding.Encode(out, sealed)
	return out, true, nil
}

// DecodeEntry returns the entry stored in env, decrypting it with key when
// the envelope is encrypted. It does not check the chain (see Verify).
func DecodeEntry(env Envelope, key []byte) (Entry, error) {
	var e Entry
	plain := []byte(env.Data)
	if env.Encrypted {
		if key == nil {
			return e, fmt.Errorf("audit entry %s#%d is encrypted (hint: pass the audit key)", env.OperationID, env.Seq)
		}
		aead, err := newAEAD(key)
		if err != nil {
			return e, err
		}
		sealed, err := base64.StdEncoding.DecodeString(env.Data)
		if err != nil {
			return e, fmt.Errorf("failed to decode audit entry %s#%d: %w", env.OperationID, env.Seq, err)
		}
		if len(sealed) < aead.NonceSize() {
			return e, fmt.Errorf("failed to decrypt audit entry %s#%d: ciphertext too short", env.OperationID, env.Seq)
		}
		nonce, ct := sealed[:aead.NonceSize()], sealed[aead.NonceSize():]
		plain, err = aead.Open(nil, nonce, ct, []byte(aadPrefix+env.OperationID))
		if err != nil {
			return e, fmt.Errorf("failed to decrypt audit entry %s#%d (hint: wrong audit key?): %w", env.OperationID, env.Seq, err)
		}
	}
	if err := json.Unmarshal(plain, &e); err != nil {
		return e, fmt.Errorf("failed to decode audit entry %s#%d: %w", env.OperationID, env.Seq, err)
	}
	return e, nil
}

func newAEAD(key []byte) (cipher.AEAD, error) {
	if len(key) != KeySize {
		return nil, fmt.Errorf("audit key has %d bytes, want %d", len(key), KeySize)
	}
	block, err := aes.NewCipher(key)
	if err != nil {
		return nil, fmt.Errorf("failed to use audit key: %w", err)
	}
	return cipher.NewGCM(block)
}

// LoadKey reads an audit encryption key file: exactly 32 raw bytes, or 64
// hex characters (surrounding whitespace allowed). Generate one with
// `head -c 32 /dev/urandom > audit.key` or `openssl rand -hex 32 > audit.key`.
func LoadKey(path string) ([]byte, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("failed to read audit key: %w", err)
	}
	if len(b) == KeySize {
		return b, nil
	}
	t := bytes.TrimSpace(b)
	if len(t) == 2*KeySize {
		k := make([]byte, KeySize)
		if _, err := hex.Decode(k, t); err == nil {
			return k, nil
		}
	}
	return nil, fmt.Errorf("audit key %s: %w (hint: create one with `openssl rand -hex 32 > %s`)", path, errBadKey, path)
}

var errBadKey = errors.New("want 32 raw bytes or 64 hex characters")
