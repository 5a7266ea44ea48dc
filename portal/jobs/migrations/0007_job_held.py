from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [("jobs", "0006_idempotency_fingerprint")]

    operations = [
        migrations.AddField(model_name="job", name="held", field=models.BooleanField(default=False)),
    ]
